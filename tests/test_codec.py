"""Every wire message round-trips through its channel codec; anything else is MalformedMessage."""

from __future__ import annotations

import inspect
import typing

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ipc import codec as C
from ipc import messages as m
from ipc.codec import Codec, MalformedMessage
from ipc.topology import Topology

pytestmark = pytest.mark.timeout(120)

PARAMS = m.SamplingParams(
    max_tokens=7,
    temperature=0.5,
    top_k=40,
    top_p=0.9,
    min_p=0.05,
    repetition_penalty=1.1,
    presence_penalty=0.2,
    frequency_penalty=0.3,
    logit_bias={5: -100.0, 9: 2.5},
    min_tokens=2,
    ignore_eos=True,
    stop_token_ids=[2, 3],
    stop=["\n\n", "END"],
    include_stop_str_in_output=True,
    skip_special_tokens=False,
    logprobs=3,
    seed=1234,
    priority=-1,
)
DELTA = m.Delta(
    "req-1",
    token_index=4,
    char_offset=17,
    text="héllo",
    token_ids=m.pack_ids([10, 11]),
    logprobs=b"\x00\x00\x80\xbf" * 2,
    top_logprobs=[{10: -1.0, 12: -2.0}, {11: -0.5}],
    finish_reason="stop",
    usage=m.Usage(5, 6, cached_tokens=2),
)
UPDATE = m.TokenUpdate(
    "req-1",
    tokenizer_id=1,
    start_index=0,
    token_ids=m.pack_ids([1, 2, 3]),
    logprobs=b"\x00" * 12,
    top_logprobs=[{1: -0.1}],
    finish_reason="length",
    prompt_tokens=9,
    cached_tokens=4,
    params=PARAMS,
)
STEP_TOKENS = m.StepTokens(
    ["a", "b"],
    [0, 1],
    m.pack_ids([3, 0]),
    m.pack_ids([7, 8]),
    b"\x00\x00\x80\xbf" * 2,
    [[], [{8: -1.0}]],
    [None, "stop"],
    [4, 5],
    [0, 2],
)

EXAMPLES: dict[str, list] = {
    "CLIENT_REQUEST": [
        m.Generate("a", prompt="hi", params=PARAMS, stream=False),
        m.Generate(
            "b",
            messages=[
                m.ChatMessage("user", "hey"),
                m.ChatMessage("user", [m.TextPart("and "), m.ImagePart("data:image/png;base64,iVBO")]),
            ],
            resume_output_ids=m.pack_ids([7]),
            resume_num_chars=3,
        ),
        m.Generate("c", prompt_token_ids=m.pack_ids([1, 2])),
        m.Abort("a"),
        m.Health(),
        m.AdapterCommand("a", "unload", "sql", wait=False),
    ],
    "CLIENT_REPLY": [
        DELTA,
        m.Delta("r", 0, 0, "", b""),
        m.ErrorReply("a", "overloaded", "busy"),
        m.HealthReply(0, True, "smol", 3, 2048),
        m.AdapterReply("a", adapters={"sql": "/adapters/sql"}),
    ],
    "SCHEDULER_INPUT": [
        m.SubmitRequest("a", 2, m.pack_ids([1, 2]), PARAMS, output_ids=m.pack_ids([3]), arrival_time=1.5),
        m.SubmitRequest(
            "b",
            0,
            m.pack_ids([1, 9, 9, 2]),
            PARAMS,
            images=[m.PromptImage(1, 2, 0, m.SlotRef(4, 6), b"k" * 16)],
        ),
        m.AbortRequest("a", "stop"),
        m.QueryRequests(1, ["a", "b"]),
        m.AdapterRequest(1, m.AdapterCommand("a", "load", "sql", "/adapters/sql")),
    ],
    "DETOKENIZER_INPUT": [
        m.TokenBatch([UPDATE, m.TokenUpdate("b", 0, 3, m.pack_ids([4]))]),
        STEP_TOKENS,
        m.DropRequests(["a", "b"]),
    ],
    "TOKENIZER_INPUT": [
        m.DeltaBatch([DELTA]),
        m.RequestFailed("a", "prompt_too_long", "too long"),
        m.RequestProgress(["a", "b"], [3, -1]),
        m.RequestProgress(["a"], [-1], is_ready=False),
        m.UntrackedRequests(["a", "b"]),
        m.ResubmitAll(0),
        m.AdapterReply("a", "adapter_in_use", "2 requests use it", {"sql": "/adapters/sql"}),
    ],
    "CONTROL_UP": [
        m.Ready("scheduler-0", 42, {"model": "smol"}),
        m.Heartbeat("worker-0", 43, 1000, True, m.StageLoad(1, 2, 0.5, 3, 4, 5)),
    ],
    "CONTROL_DOWN": [
        m.Shutdown(),
        m.Reconfigure("DEBUG", 100, 64),
        m.TopologyChanged(Topology(2, 2, 1, 3, 2, 1, {"scheduler-0": "10.0.0.7"})),
        m.ResubmitAll(1),
        m.ResubmitShard(0, 2),
        m.GroupLoads([1.5, 0.0]),
    ],
    "WORKER_INPUT": [
        m.WorkerHello(
            0,
            2,
            44,
            "smol",
            "float32",
            "cpu",
            512,
            16,
            49152,
            2048,
            [2],
            adapters=[m.AdapterSource("sql", "/adapters/sql")],
        ),
        m.LoadAdapter(m.AdapterSource("sql", "/adapters/sql"), load_id=3),
        m.UnloadAdapter("sql"),
    ],
    "WORKER_OUTPUT": [
        m.WorkerHello(0, 2, 44, "smol", "float32", "cpu", 512, 16, 49152, 2048, [2]),
        m.AdapterLoaded(0, "sql", "adapter 'sql': rank 128 is over lora.max_rank (64)", load_id=3),
    ],
    "STEP_HEADER": [
        m.StepHeader(7, 100, 4, 5),
        m.StepHeader(8, 1, 1, 0, ["sql", ""]),
        m.StepHeader(9, 1, 1, 0, ["sql", ""], ["", "chat"]),
    ],
    "RESULT_HEADER": [m.ResultHeader(7, 4), m.ResultHeader(8, 0, "bad block")],
    "ENCODER_REQUEST": [m.EncodeImages("r1", [b"\x89PNG...", b"GIF89a..."])],
    "ENCODER_REPLY": [
        m.ImagesEncoded("r1", [b"k" * 16], [m.SlotRef(3, 8)]),
        m.ImagesEncoded("r2", error="images[1]: the image/png data is truncated or corrupt"),
    ],
}
CODECS: dict[str, Codec] = {name: obj for name, obj in vars(C).items() if isinstance(obj, Codec)}


def channel_types(codec: Codec) -> tuple[type, ...]:
    """The message classes a codec decodes (the members of its union)."""
    decoded = codec._decoder.type
    return typing.get_args(decoded) or (decoded,)


def struct_types(value: object) -> set[type]:
    """The types of `value` and of every struct inside it."""
    if isinstance(value, msgspec.Struct):
        return {type(value)}.union(*(struct_types(getattr(value, f)) for f in value.__struct_fields__))
    if isinstance(value, list | tuple):
        return set().union(*(struct_types(item) for item in value))
    if isinstance(value, dict):
        return set().union(*(struct_types(item) for item in value.values()))
    return set()


def test_examples_cover_every_codec_and_message():
    assert set(EXAMPLES) == set(CODECS)
    tagged = {
        cls
        for _, cls in inspect.getmembers(m, inspect.isclass)
        if issubclass(cls, msgspec.Struct) and cls.__module__ == m.__name__ and cls.__struct_config__.tag
    }
    covered = set().union(*(struct_types(msg) for msgs in EXAMPLES.values() for msg in msgs))
    assert tagged <= covered  # a tagged struct inside a message (a chat's content parts) counts
    for name, msgs in EXAMPLES.items():
        assert {type(msg) for msg in msgs} == set(channel_types(CODECS[name])), name


@pytest.mark.parametrize("name", sorted(EXAMPLES))
def test_round_trip(name):
    codec = CODECS[name]
    for msg in EXAMPLES[name]:
        data = codec.encode(msg)
        assert codec.decode(data) == msg
        assert codec.decode(memoryview(data)) == msg  # frames arrive as memoryviews


def test_wrong_channel_and_truncation_are_malformed():
    submit = C.SCHEDULER_INPUT.encode(EXAMPLES["SCHEDULER_INPUT"][0])
    with pytest.raises(MalformedMessage):
        C.DETOKENIZER_INPUT.decode(submit)
    for cut in range(len(submit)):
        with pytest.raises(MalformedMessage):
            C.SCHEDULER_INPUT.decode(submit[:cut])
    with pytest.raises(MalformedMessage):
        C.CLIENT_REQUEST.decode(b"\x91" * 100_000)  # absurdly deep nesting


def test_ragged_step_tokens_are_malformed():
    # Columns of different lengths would pair one request's token with another's id.
    good = msgspec.msgpack.decode(C.DETOKENIZER_INPUT.encode(STEP_TOKENS))
    for column in range(1, len(good)):  # after the tag
        ragged = list(good)
        ragged[column] = ragged[column][1:]
        with pytest.raises(MalformedMessage):
            C.DETOKENIZER_INPUT.decode(msgspec.msgpack.encode(ragged))
    assert C.DETOKENIZER_INPUT.decode(msgspec.msgpack.encode(good)) == STEP_TOKENS


def test_ragged_request_progress_is_malformed():
    # An answer that pairs counts with the wrong ids would make a tokenizer resubmit or fail them.
    ragged = msgspec.msgpack.encode(["RequestProgress", ["a", "b"], [3]])
    with pytest.raises(MalformedMessage):
        C.TOKENIZER_INPUT.decode(ragged)


def test_request_progress_of_a_scheduler_without_is_ready_reads_as_ready():
    # A scheduler started from an older checkout sends no is_ready: its answers count as before.
    old = msgspec.msgpack.encode(["RequestProgress", ["a"], [-1]])
    assert C.TOKENIZER_INPUT.decode(old) == m.RequestProgress(["a"], [-1], is_ready=True)


def assert_malformed_or_valid(codec: Codec, data: bytes) -> None:
    try:
        msg = codec.decode(data)
    except MalformedMessage:
        return
    assert isinstance(msg, channel_types(codec))


scalars = (
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**63), max_value=2**64 - 1)
    | st.floats(allow_nan=False)
    | st.text(max_size=20)
    | st.binary(max_size=20)
)
values = st.recursive(
    scalars,
    lambda children: (
        st.lists(children, max_size=6)
        | st.dictionaries(st.text(max_size=10) | st.integers(-(2**31), 2**31), children, max_size=6)
    ),
    max_leaves=20,
)


@settings(max_examples=200, deadline=None)  # hangs are caught by the test timeout
@given(data=st.binary(max_size=512))
def test_random_bytes_are_malformed_or_valid(data):
    for codec in CODECS.values():
        assert_malformed_or_valid(codec, data)


@settings(max_examples=200, deadline=None)  # hangs are caught by the test timeout
@given(value=values)
def test_random_msgpack_structures_are_malformed_or_valid(value):
    data = msgspec.msgpack.encode(value)
    for codec in CODECS.values():
        assert_malformed_or_valid(codec, data)


def mutate(obj, draw, depth: int = 0):
    """Replace one element somewhere inside a builtins tree with a random value."""
    if isinstance(obj, (list, dict)) and obj and depth < 6 and draw(st.booleans()):
        keys = list(range(len(obj))) if isinstance(obj, list) else list(obj)
        key = draw(st.sampled_from(keys))
        obj[key] = mutate(obj[key], draw, depth + 1)
        return obj
    return draw(values)


@settings(max_examples=200, deadline=None)  # hangs are caught by the test timeout
@given(data=st.data())
def test_wrong_typed_fields_are_malformed_or_valid(data):
    name = data.draw(st.sampled_from(sorted(EXAMPLES)))
    msg = data.draw(st.sampled_from(EXAMPLES[name]))
    tree = msgspec.to_builtins(msg, builtin_types=(bytes,))
    assert_malformed_or_valid(CODECS[name], msgspec.msgpack.encode(mutate(tree, data.draw)))
