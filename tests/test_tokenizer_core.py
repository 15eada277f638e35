"""The tokenizer's core without sockets: admission, group choice, journal, and relaying deltas by
absolute position (exactly once, whatever upstream re-sends)."""

from __future__ import annotations

from pathlib import Path

import pytest

from client.sdk import chat_message
from ipc import messages as m
from ipc.endpoints import shard_of
from services.common.text import Tokenizer
from services.tokenizer.core import MAX_REDRIVES, RequestError, TokenizerCore, engine_id, trim_delta

STALL_S = 10.0


@pytest.fixture(scope="module")
def core_factory(smollm2_dir: Path):
    tokenizer = Tokenizer(smollm2_dir)

    def make(num_groups: int = 1) -> TokenizerCore:
        return TokenizerCore(
            tokenizer,
            0,
            num_groups,
            max_model_len=256,
            max_prompt_chars=1000,
            default_max_tokens=7,
            stall_timeout_s=STALL_S,
        )

    return make


def test_admission_fills_seed_and_default_max_tokens(core_factory) -> None:
    core = core_factory()
    entry = core.admit(b"c", m.Generate("r", prompt="Hello there"))
    assert entry.submit.params.max_tokens == 7
    assert entry.submit.params.seed is not None
    assert m.unpack_ids(entry.submit.prompt_ids).tolist() == core.tokenizer.encode("Hello there")


@pytest.mark.parametrize(
    ("request_", "code"),
    [
        (m.Generate("", prompt="x"), "invalid_request"),
        (m.Generate("r"), "invalid_request"),
        (m.Generate("r", prompt="x", messages=[m.ChatMessage("user", "y")]), "invalid_request"),
        (m.Generate("r", messages=[m.ChatMessage("robot", "y")]), "invalid_request"),
        (m.Generate("r", prompt="x" * 1001), "prompt_too_long"),
        (m.Generate("r", prompt="hello " * 300), "prompt_too_long"),
        (m.Generate("r", prompt_token_ids=m.pack_ids([10**8])), "invalid_request"),
        (m.Generate("r", prompt_token_ids=b"\x01\x02\x03"), "invalid_request"),
        (m.Generate("r", prompt="x", params=m.SamplingParams(top_p=0.0)), "invalid_request"),
    ],
)
def test_bad_requests_get_specific_codes(core_factory, request_: m.Generate, code: str) -> None:
    core = core_factory()
    with pytest.raises(RequestError) as info:
        core.admit(b"c", request_)
    assert info.value.code == code
    assert not core.journal


def test_group_choice_follows_reported_load(core_factory) -> None:
    core = core_factory(num_groups=2)
    core.group_loads = [10.0, 2.0]
    assert core.admit(b"c", m.Generate("a", prompt="x")).group == 1
    core.group_loads = [1.0, 2.0]
    assert core.admit(b"c", m.Generate("b", prompt="x")).group == 0
    core.abort(b"c", "b")
    core.group_loads = [0.0, 0.0]  # equal reports: our own in-flight request ("a") breaks the tie
    assert core.admit(b"c", m.Generate("c", prompt="x")).group == 0


def test_retiring_groups_take_no_new_requests_and_hand_theirs_over(core_factory) -> None:
    """engine.data_parallel 3 -> 2 (hot reload): new requests avoid group 2 at once; once it has
    stopped, its requests move, with their outputs so far, to the least loaded of the others."""
    core = core_factory(num_groups=3)
    core.group_loads = [5.0, 5.0, 0.0]
    on_two = core.admit(b"c", m.Generate("a", prompt="x"))
    assert on_two.group == 2
    core.relay(m.Delta(on_two.submit.request_id, 0, 0, "ab", m.pack_ids([5, 6])))
    core.set_num_groups(2)
    assert core.admit(b"c", m.Generate("b", prompt="x")).group in (0, 1)
    core.group_loads = [3.0, 1.0]
    [(group, again)] = core.move_retired()
    assert group == 1 and core.journal[on_two.submit.request_id].group == 1
    assert again.request_id == on_two.submit.request_id and m.unpack_ids(again.output_ids).tolist() == [5, 6]
    assert core.move_retired() == []  # nothing is left on a retired group
    core.set_num_groups(3)  # grown again: the new group is chosen when it is the least loaded
    core.group_loads = [9.0, 9.0, 0.0]
    assert core.admit(b"c", m.Generate("c", prompt="x")).group == 2


def test_relay_is_exactly_once_by_position(core_factory) -> None:
    core = core_factory()
    r = core.admit(b"c", m.Generate("r", prompt="x")).submit.request_id  # the engine's id
    first = core.relay(m.Delta(r, 0, 0, "Hel", m.pack_ids([1, 2])))
    assert first is not None and first.message.text == "Hel" and first.message.request_id == "r"
    again = m.Delta(r, 0, 0, "Hello", m.pack_ids([1, 2, 3]))  # re-sent from the start (a resync)
    reply = core.relay(again)
    assert reply is not None
    assert (reply.message.text, reply.message.token_index, reply.message.char_offset) == ("lo", 2, 3)
    assert m.unpack_ids(reply.message.token_ids).tolist() == [3]
    assert core.relay(again) is None  # nothing new
    assert core.relay(m.Delta(r, 9, 20, "gap", m.pack_ids([9]))) is None  # a gap is not forwarded
    done = core.relay(m.Delta(r, 3, 5, "!", m.pack_ids([4]), finish_reason="stop"))
    assert done is not None and done.message.finish_reason == "stop"
    assert not core.journal and not core.engine_ids


def test_resubmission_carries_what_the_client_has(core_factory) -> None:
    core = core_factory(num_groups=2)
    entry = core.admit(b"c", m.Generate("r", prompt="x"))
    core.relay(m.Delta(entry.submit.request_id, 0, 0, "ab", m.pack_ids([5, 6])))
    (again,) = core.resubmissions(entry.group)
    assert m.unpack_ids(again.output_ids).tolist() == [5, 6]
    assert again.params.seed == entry.submit.params.seed
    assert core.resubmissions(1 - entry.group) == []


def test_trim_delta_keeps_logprobs_aligned() -> None:
    delta = m.Delta(
        "r",
        0,
        0,
        "abc",
        m.pack_ids([1, 2, 3]),
        logprobs=b"".join(x.to_bytes(4, "little") for x in (11, 22, 33)),
    )
    trimmed = trim_delta(delta, num_tokens=2, num_chars=1)
    assert trimmed is not None
    assert m.unpack_ids(trimmed.token_ids).tolist() == [3]
    assert trimmed.logprobs == (33).to_bytes(4, "little")
    assert trimmed.text == "bc"


def test_resume_num_chars_cannot_exceed_the_resumed_text(core_factory) -> None:
    """Issue 14 item 2: a resume claiming more characters than its tokens decode to would put
    every delta behind a gap that never closes; it is refused at once instead."""
    core = core_factory()
    ids = core.tokenizer.encode("Hello world")
    text = core.tokenizer.decode(ids)
    for claimed in (len(text) + 1, 10**12):
        with pytest.raises(RequestError, match="resume_num_chars") as info:
            core.admit(
                b"c", m.Generate("r", prompt="x", resume_output_ids=m.pack_ids(ids), resume_num_chars=claimed)
            )
        assert info.value.code == "invalid_request"
    with pytest.raises(RequestError, match="resume_num_chars"):
        core.admit(b"c", m.Generate("r", prompt="x", resume_num_chars=1))  # characters of no tokens
    entry = core.admit(
        b"c", m.Generate("r", prompt="x", resume_output_ids=m.pack_ids(ids), resume_num_chars=len(text))
    )
    assert (entry.output_ids, entry.num_chars) == (ids, len(text))


def quiet_since(entry) -> float:
    """Where the tests' simulated clock starts for `entry`: its last progress, pinned to a whole
    second. The tests step the clock by STALL_S, and only whole numbers add exactly: 10 added to
    an arbitrary monotonic reading can come out a hair under 10 later, and the watchdog rightly
    says "not yet" (a flake, about once in a few hundred runs)."""
    entry.progress_at = float(int(entry.progress_at))
    return entry.progress_at


def ask(core: TokenizerCore, now: float) -> list[str]:
    """The ids the watchdog asks group 0's scheduler about at `now`."""
    return core.stalled(now).get(0, [])


def test_watchdog_leaves_a_legitimately_quiet_request_alone(core_factory) -> None:
    """A long queue or prefill: the scheduler holds what the client has. Asked again and again,
    the tokenizer never resubmits it (a resubmission would restart the prefill: a livelock)."""
    core = core_factory()
    entry = core.admit(b"c", m.Generate("r", prompt="x"))
    r = entry.submit.request_id  # the engine's id, which the scheduler is asked about
    now = quiet_since(entry)
    assert ask(core, now + STALL_S / 2) == []  # not quiet for long enough yet
    for round_ in range(1, 6):
        now += STALL_S
        assert ask(core, now) == [r]
        assert ask(core, now + 1) == []  # asked already: not again before another timeout
        assert core.on_progress(m.RequestProgress([r], [0]), now + 1) == ([], []), round_


def test_watchdog_redrives_a_request_the_engine_lost(core_factory) -> None:
    """The scheduler no longer runs a request the client has no end of: after two answers in a
    row say so, it is resubmitted with what the client has. An answer about a request that
    moved on since the question changes nothing."""
    core = core_factory()
    entry = core.admit(b"c", m.Generate("r", prompt="x"))
    r = entry.submit.request_id
    core.relay(m.Delta(r, 0, 0, "ab", m.pack_ids([5, 6])))
    now = quiet_since(entry) + STALL_S
    assert ask(core, now) == [r]
    # Its final text may still be on its way through the detokenizer: wait for a second answer.
    assert core.on_progress(m.RequestProgress([r], [-1]), now) == ([], [])
    now += STALL_S
    assert ask(core, now) == [r]
    redrive, failed = core.on_progress(m.RequestProgress([r], [-1]), now)
    assert redrive == [entry] and failed == []
    assert m.unpack_ids(core.resubmission(entry).output_ids).tolist() == [5, 6]

    # Progress between two answers starts the count over.
    now += STALL_S
    assert ask(core, now) == [r]
    assert core.on_progress(m.RequestProgress([r], [-1]), now) == ([], [])
    assert ask(core, now + STALL_S) == [r]
    core.relay(m.Delta(r, 2, 2, "c", m.pack_ids([7])))
    assert core.on_progress(m.RequestProgress([r], [-1]), now) == ([], [])  # moved since asked
    now += 2 * STALL_S
    assert ask(core, now) == [r]
    assert core.on_progress(m.RequestProgress([r], [-1]), now) == ([], [])  # the first of two again
    now += STALL_S
    assert ask(core, now) == [r]
    assert core.on_progress(m.RequestProgress([r], [-1]), now) == ([entry], [])


def test_a_starting_scheduler_loses_nothing(core_factory) -> None:
    """A restarted scheduler waiting for its workers runs none of the journal's requests until
    ResubmitAll brings them: its answers, however many, resubmit nothing. Nor do answers given
    before it had the resubmission, which share its link. Then the watchdog works as before."""
    core = core_factory()
    entry = core.admit(b"c", m.Generate("r", prompt="x"))
    r = entry.submit.request_id
    core.relay(m.Delta(r, 0, 0, "ab", m.pack_ids([5, 6])))
    now = quiet_since(entry)
    for _ in range(5):
        now += STALL_S
        assert ask(core, now) == [r]
        assert core.on_progress(m.RequestProgress([r], [-1], is_ready=False), now) == ([], [])

    # Ready, and the tokenizer not yet told (ResubmitAll comes from the supervisor): one answer
    # that it runs nothing, and a question asked before the resubmission, so answered before the
    # scheduler reads it, and heard after it: not a second loss in a row.
    now += STALL_S
    assert ask(core, now) == [r]
    assert core.on_progress(m.RequestProgress([r], [-1]), now) == ([], [])
    now += STALL_S
    assert ask(core, now) == [r]
    assert m.unpack_ids(core.resubmissions(0)[0].output_ids).tolist() == [5, 6]
    assert core.on_progress(m.RequestProgress([r], [-1]), now) == ([], [])
    now += STALL_S
    assert ask(core, now) == [r]
    assert core.on_progress(m.RequestProgress([r], [2]), now) == ([], [])

    # Lost later by the live scheduler: still found, two answers in a row.
    for answer in (([], []), ([entry], [])):
        now += STALL_S
        assert ask(core, now) == [r]
        assert core.on_progress(m.RequestProgress([r], [-1]), now) == answer


def test_a_scheduler_that_never_comes_up_fails_its_requests(core_factory) -> None:
    """Waiting for a starting scheduler has a deadline: start_timeout_s after its first answer
    that it is starting, the request fails with an error that says why, instead of hanging."""
    core = core_factory()
    entry = core.admit(b"c", m.Generate("r", prompt="x"))
    r = entry.submit.request_id
    now = quiet_since(entry) + STALL_S
    first = now
    failed: list = []
    while not failed:
        assert now - first < core.start_timeout_s + 2 * STALL_S, "no deadline"
        assert ask(core, now) == [r]
        redrive, failed = core.on_progress(m.RequestProgress([r], [0], is_ready=False), now)
        assert redrive == []
        now += STALL_S
    assert now - STALL_S - first >= core.start_timeout_s
    (reply,) = failed
    assert isinstance(reply.message, m.ErrorReply)
    assert (reply.message.request_id, reply.message.code) == ("r", "unavailable")
    assert "did not come up" in reply.message.message
    assert r not in core.journal


def test_a_gap_cannot_strand_a_request(core_factory) -> None:
    """Deltas past a gap are never forwarded, and the request is not left waiting: the scheduler
    holds tokens the client never got, so the watchdog re-drives it from the client's position.
    One that keeps getting lost fails with a clear error rather than waiting forever."""
    core = core_factory()
    entry = core.admit(b"c", m.Generate("r", prompt="x", stream=False))
    r = entry.submit.request_id
    core.relay(m.Delta(r, 0, 0, "ab", m.pack_ids([5, 6])))
    assert core.relay(m.Delta(r, 4, 4, "ef", m.pack_ids([9, 10]), finish_reason="length")) is None
    assert core.num_gaps == 1 and r in core.journal
    now = quiet_since(entry)
    redrives = 0
    failed: list = []
    while not failed:
        assert redrives <= MAX_REDRIVES
        for _ in range(2):
            now += STALL_S
            assert ask(core, now) == [r]
            redrive, failed = core.on_progress(m.RequestProgress([r], [6]), now)
        if redrive:
            assert redrive == [entry] and entry.output_ids == [5, 6]
            redrives += 1
    assert redrives == MAX_REDRIVES
    (reply,) = failed
    assert isinstance(reply.message, m.ErrorReply)
    assert (reply.message.request_id, reply.message.code) == ("r", "internal")
    assert "lost" in reply.message.message
    assert r not in core.journal


def test_detokenizer_restart_resubmits_exactly_its_shard(core_factory) -> None:
    core = core_factory(num_groups=2)
    ids = [core.admit(b"c", m.Generate(f"req-{i}", prompt="x")).submit.request_id for i in range(12)]
    core.relay(m.Delta(ids[0], 0, 0, "ab", m.pack_ids([5, 6])))
    for shard in range(3):
        again = core.shard_resubmissions(shard, 3)
        assert sorted(s.request_id for _, s in again) == sorted(r for r in ids if shard_of(r, 3) == shard)
        for group, submit in again:
            assert group == core.journal[submit.request_id].group
            assert m.unpack_ids(submit.output_ids).tolist() == core.journal[submit.request_id].output_ids


def test_request_ids_are_scoped_to_the_connection(core_factory) -> None:
    """Two clients that pick the same request id get two engine requests, each relayed to its own
    client; neither can abort the other's."""
    core = core_factory()
    mine = core.admit(b"alice", m.Generate("job-1", prompt="x"))
    theirs = core.admit(b"mallory", m.Generate("job-1", prompt="y"))
    assert mine.submit.request_id != theirs.submit.request_id
    assert mine.submit.request_id == engine_id(0, b"alice", "job-1")  # what a test may name upstream
    assert len(core.journal) == 2
    reply = core.relay(m.Delta(mine.submit.request_id, 0, 0, "a", m.pack_ids([5])))
    assert reply is not None and reply.identity == b"alice" and reply.message.request_id == "job-1"
    assert core.abort(b"mallory", "job-2") is None
    assert core.abort(b"eve", "job-1") is None
    assert mine.submit.request_id in core.journal
    assert core.abort(b"mallory", "job-1") is theirs
    assert list(core.journal) == [mine.submit.request_id]


def test_a_resubmission_on_the_same_connection_keeps_the_engine_id(core_factory) -> None:
    core = core_factory()
    first = core.admit(b"c", m.Generate("r", prompt="x"))
    ids = core.tokenizer.encode("Hello")
    resumed = m.Generate("r", prompt="x", resume_output_ids=m.pack_ids(ids), resume_num_chars=len("Hello"))
    again = core.admit(b"c", resumed)
    assert again.submit.request_id == first.submit.request_id and len(core.journal) == 1
    assert core.fail(m.RequestFailed(again.submit.request_id, "internal", "boom")).message == m.ErrorReply(
        "r", "internal", "boom"
    )
    assert not core.journal and not core.engine_ids


def test_constraints_are_checked_at_admission_naming_the_field(core_factory) -> None:
    """A constraint that does not compile, or one combined with min_tokens, is refused before it
    enters the pipeline; a good one passes, and a repeated check is answered from the cache."""
    core = core_factory()

    def generate(spec: m.StructuredOutput, **params: object) -> m.Generate:
        return m.Generate("r", prompt="x", params=m.SamplingParams(structured=spec, **params))

    bad = m.StructuredOutput("json", '{"type": "array", "uniqueItems": true}')
    for _ in range(2):  # the second answer comes from the tokenizer's cache of checked constraints
        with pytest.raises(RequestError, match=r"structured\.json: .*uniqueItems") as info:
            core.admit(b"c", generate(bad))
        assert info.value.code == "invalid_request"
    with pytest.raises(RequestError, match=r"structured\.regex: "):
        core.admit(b"c", generate(m.StructuredOutput("regex", "([")))
    good = m.StructuredOutput("regex", "[0-9]{3}")
    with pytest.raises(RequestError, match="min_tokens cannot be combined"):
        core.admit(b"c", generate(good, min_tokens=1))
    entry = core.admit(b"c", generate(good))
    assert entry.submit.params.structured == good
    assert list(core.journal) == [entry.submit.request_id]


# -- the per-request work budget (issue #29): the tokenizer renders and encodes on one thread ---


def budget_core(smollm2_dir: Path, **budget) -> TokenizerCore:
    """A core whose context is long enough that only the budget can refuse these requests."""
    kwargs = {"max_prompt_chars": 1000, **budget}
    return TokenizerCore(Tokenizer(smollm2_dir), 0, 1, max_model_len=8192, default_max_tokens=7, **kwargs)


def tool_turn(arguments: str, name: str = "f", call_id: str = "call_0") -> m.ChatMessage:
    return m.ChatMessage("assistant", None, tool_calls=[m.ToolCall(call_id, name, arguments)])


@pytest.mark.parametrize(
    "messages",
    [
        [m.ChatMessage("user", "hi"), tool_turn('{"x": "' + "a" * 1000 + '"}')],  # arguments
        [m.ChatMessage("user", "hi"), tool_turn("{}", name="f" * 1000)],  # the function's name
        [m.ChatMessage("user", "hi"), tool_turn("{}", call_id="c" * 1000)],  # the call's id
        [m.ChatMessage("user", "hi", name="n" * 1000)],
        [m.ChatMessage("tool", "ok", tool_call_id="t" * 1000)],
    ],
    ids=["arguments", "call name", "call id", "name", "tool_call_id"],
)
def test_every_text_that_reaches_the_template_counts_toward_max_prompt_chars(
    smollm2_dir: Path, messages: list[m.ChatMessage]
) -> None:
    """Only `content` and the tools JSON were counted: 6M characters of tool-call arguments went
    through to the template and the encoder, and stalled every stream for 10 s."""
    core = budget_core(smollm2_dir)
    with pytest.raises(
        RequestError, match=r"^prompt: \d+ characters in the messages.*tokenizer.max_prompt_chars"
    ):
        core.admit(b"c", m.Generate("r", messages=messages))
    assert not core.journal


def test_more_messages_than_max_messages_are_refused_before_rendering(smollm2_dir: Path) -> None:
    core = budget_core(smollm2_dir, max_messages=8)
    messages = [m.ChatMessage("user", "a")] * 9
    with pytest.raises(
        RequestError, match=r"^messages: 9 messages; the limit is 8 \(tokenizer.max_messages\)"
    ) as info:
        core.admit(b"c", m.Generate("r", messages=messages))
    assert info.value.code == "invalid_request"
    assert core.admit(b"c", m.Generate("ok", messages=messages[:8])).request_id == "ok"


def test_the_rendered_prompt_counts_toward_max_prompt_chars(smollm2_dir: Path) -> None:
    """The template adds text of its own to every message (many one-character messages render to
    a prompt many times their size, full of special tokens, the slowest text to encode)."""
    core = budget_core(smollm2_dir)
    messages = [m.ChatMessage("user", "a")] * 150  # 750 characters in, more than 2000 rendered
    with pytest.raises(
        RequestError, match=r"^prompt: \d+ characters once rendered by the chat template"
    ) as info:
        core.admit(b"c", m.Generate("r", messages=messages))
    assert info.value.code == "prompt_too_long"


def test_a_template_past_its_time_budget_fails_the_request_alone(smollm2_dir: Path) -> None:
    core = budget_core(smollm2_dir, template_timeout_s=1e-9)
    with pytest.raises(
        RequestError, match=r"^messages: the chat template took more than .*template_timeout_s"
    ):
        core.admit(b"c", m.Generate("r", messages=[m.ChatMessage("user", "hi")] * 4))
    assert not core.journal
    assert core.admit(b"c", m.Generate("plain", prompt="hi")).request_id == "plain"  # no template


def test_deeply_nested_tools_json_is_refused_not_a_crash(smollm2_dir: Path) -> None:
    """json.loads on 10k levels raised RecursionError out of admit, which killed the stage."""
    core = budget_core(smollm2_dir, max_prompt_chars=100_000)
    tools = m.Tools("[" * 10_000 + "]" * 10_000)
    with pytest.raises(RequestError, match=r"^tools: JSON nested 10000 levels deep; the limit is \d+"):
        core.admit(b"c", m.Generate("r", messages=[m.ChatMessage("user", "hi")], tools=tools))


# Qwen3's way: enable_thinking false closes an empty think block in the prompt.
THINKING_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% if enable_thinking is defined and enable_thinking is false %}<think>\n\n</think>\n\n{% endif %}{% endif %}"
)


def test_chat_template_kwargs_reach_the_template(smollm2_dir: Path, tmp_path: Path) -> None:
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (tmp_path / name).write_bytes((smollm2_dir / name).read_bytes())
    (tmp_path / "chat_template.jinja").write_text(THINKING_TEMPLATE)
    core = TokenizerCore(
        Tokenizer(tmp_path), 0, 1, max_model_len=256, max_prompt_chars=1000, default_max_tokens=7
    )
    chat = [m.ChatMessage("user", "hi")]

    def prompt(**kwargs) -> str:
        entry = core.admit(b"c", m.Generate(f"r{len(core.journal)}", messages=chat, **kwargs))
        return core.tokenizer.decode(
            m.unpack_ids(entry.submit.prompt_ids).tolist(), skip_special_tokens=False
        )

    assert prompt().endswith("<|im_start|>assistant\n")
    assert prompt(chat_template_kwargs={"enable_thinking": False}).endswith(
        "assistant\n<think>\n\n</think>\n\n"
    )
    with pytest.raises(RequestError, match=r"chat_template_kwargs: \['messages'\] are set by the server"):
        prompt(chat_template_kwargs={"messages": []})


# Qwen3's way with earlier thinking: an assistant turn's reasoning_content in a think block.
REASONING_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m.role }}\n"
    "{% if m.reasoning_content %}<think>{{ m.reasoning_content }}</think>{% endif %}"
    "{{ m.content }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


@pytest.mark.parametrize("template", [REASONING_TEMPLATE, REASONING_TEMPLATE + "{% if tools %}{% endif %}"])
def test_an_assistant_turns_reasoning_reaches_the_template(
    smollm2_dir: Path, tmp_path: Path, template
) -> None:
    """An assistant turn's thinking sent back (`reasoning` or `reasoning_content` in the
    gateway's and the SDK's messages) is the template's `reasoning_content`, whether the
    template renders tools or not, and counts against the prompt's character budget."""
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (tmp_path / name).write_bytes((smollm2_dir / name).read_bytes())
    (tmp_path / "chat_template.jinja").write_text(template)
    core = TokenizerCore(
        Tokenizer(tmp_path), 0, 1, max_model_len=256, max_prompt_chars=1000, default_max_tokens=7
    )
    for said in ({"reasoning": "sum it"}, {"reasoning_content": "sum it"}):
        chat = [chat_message(0, {"role": "user", "content": "2+2?"}),
                chat_message(1, {"role": "assistant", "content": "4", **said})]  # fmt: skip
        entry = core.admit(b"c", m.Generate(f"r{len(core.journal)}", messages=chat))
        prompt = core.tokenizer.decode(
            m.unpack_ids(entry.submit.prompt_ids).tolist(), skip_special_tokens=False
        )
        assert "<|im_start|>assistant\n<think>sum it</think>4<|im_end|>" in prompt, prompt
    long_thought = [m.ChatMessage("user", "hi"), m.ChatMessage("assistant", "ok", reasoning="x" * 1000)]
    with pytest.raises(RequestError, match=r"^prompt: 1017 characters in the messages"):
        core.admit(b"c", m.Generate("long", messages=long_thought))


def test_a_client_id_reused_after_its_request_ended_gets_a_new_engine_id(core_factory) -> None:
    """The old request's abort and detokenizer drop are still on their way upstream when the
    connection sends a new request under the same id: the engine must know the two apart, or
    the old drop erases the new request's detokenizer state (a stall until the watchdog)."""
    core = core_factory()
    first = core.admit(b"c", m.Generate("r", prompt="x"))
    assert first.submit.request_id == engine_id(0, b"c", "r")
    assert core.abort(b"c", "r") is first
    second = core.admit(b"c", m.Generate("r", prompt="x"))
    assert second.submit.request_id not in (first.submit.request_id, engine_id(0, b"mallory", "r"))
    reply = core.relay(m.Delta(first.submit.request_id, 0, 0, "old", m.pack_ids([5])))
    assert reply is None  # a late delta of the old request does not reach the new one
    assert core.fail(m.RequestFailed(second.submit.request_id, "internal", "boom")).message.request_id == "r"
    third = core.admit(b"c", m.Generate("r", prompt="x"))
    assert len({first.submit.request_id, second.submit.request_id, third.submit.request_id}) == 3
    # A retry refused at admission (here: a bad truncation) does not lose the count: the next
    # admitted request under the id still gets an engine id of its own.
    core.abort(b"c", "r")
    with pytest.raises(RequestError):
        core.admit(b"c", m.Generate("r", prompt="x", truncate_prompt_tokens=-5))
    fourth = core.admit(b"c", m.Generate("r", prompt="x"))
    assert fourth.submit.request_id not in {
        first.submit.request_id,
        second.submit.request_id,
        third.submit.request_id,
    }


def vllm_bad_words_ids(hf_tokenizer, words: list[str]) -> list[list[int]]:
    """vLLM's tokenization of bad words, written out with HF's tokenizer: each word stripped of
    leading whitespace, then with a leading space where that is another first token and as long."""
    out = []
    for word in words:
        bare = hf_tokenizer.encode(word.lstrip(), add_special_tokens=False)
        spaced = hf_tokenizer.encode(" " + word.lstrip(), add_special_tokens=False)
        out.append(bare)
        if spaced[0] != bare[0] and len(spaced) == len(bare):
            out.append(spaced)
    return out


def test_bad_words_are_tokenized_as_vllm_tokenizes_them(core_factory, smollm2_dir: Path) -> None:
    """Each word, its leading whitespace stripped, as it encodes alone and, where that gives
    another first token and as many tokens, with a leading space: computed here with HF
    transformers' tokenizer. The ids travel with the request, resubmissions too."""
    from transformers import AutoTokenizer

    hf = AutoTokenizer.from_pretrained(smollm2_dir)
    words = ["hello", "  Hello world", "zzz", "<|im_end|>", "\u2603"]
    expected = vllm_bad_words_ids(hf, words)
    assert len(expected) == 9  # "<|im_end|>" once: with a space it is two tokens, not one
    core = core_factory()
    entry = core.admit(b"c", m.Generate("r", prompt="x", params=m.SamplingParams(bad_words=words)))
    assert entry.submit.params.bad_words_ids == expected
    assert entry.submit.params.bad_words == words
    (again,) = core.resubmissions(entry.group)
    assert again.params.bad_words_ids == expected


@pytest.mark.parametrize(
    ("params", "message"),
    [
        (m.SamplingParams(bad_words_ids=[[5]]), "^bad_words_ids are the tokenizer's to make from bad_words"),
        (m.SamplingParams(bad_words=["ok", " \t"]), r"^bad_words\[1\] is empty or only whitespace"),
        (m.SamplingParams(bad_words=["x" * 257]), r"^bad_words\[0\] has 257 characters, at most 256"),
        (m.SamplingParams(bad_words=["\u2603" * 86]), r"^bad_words\[0\] is 258 tokens long, at most 256"),
        (m.SamplingParams(bad_words=["w"] * 65), "^bad_words has 65 entries, at most 64"),
        (m.SamplingParams(allowed_token_ids=[]), "^allowed_token_ids must not be empty"),
        (
            m.SamplingParams(allowed_token_ids=[49152]),
            r"^allowed_token_ids entry 49152 is not a token id in \[0, 49152\)",
        ),
    ],
)
def test_bad_allowed_token_ids_and_bad_words_are_refused_naming_the_field(
    core_factory, params: m.SamplingParams, message: str
) -> None:
    core = core_factory()
    with pytest.raises(RequestError, match=message) as info:
        core.admit(b"c", m.Generate("r", prompt="x", params=params))
    assert info.value.code == "invalid_request" and not core.journal
