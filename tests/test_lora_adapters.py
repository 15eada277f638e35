"""The scheduler's LoRA adapter list (services/scheduler/adapters.py) and slot residency
(services/scheduler/lora_residency.py) as plain objects: each refusal of a load or unload, a load
that serves only once every worker rank has it, an unload that waits for its requests up to its
deadline, the list a restarted scheduler reads back, and the slots' least-recently-used swaps."""

from __future__ import annotations

from pathlib import Path

import pytest

from ipc import messages as m
from ipc.config import ConfigError, load_config
from services.scheduler.adapters import LOAD_TIMEOUT_S, Adapters
from services.scheduler.lora_residency import LoraResidency
from services.scheduler.request import Request


class Harness:
    """An Adapters with its callbacks recorded, a clock to move, and users to set."""

    def __init__(self, state_file: Path, capacity: int = 2, static: dict[str, str] | None = None) -> None:
        self.now = 0.0
        self.users: dict[str, int] = {}
        self.replies: list[m.AdapterReply] = []
        self.sent: list[m.LoadAdapter | m.UnloadAdapter] = []
        self.forgotten: list[str] = []
        self.adapters = Adapters(
            capacity, static or {}, state_file, unload_wait_s=10.0, base_model="base",
            users=lambda name: self.users.get(name, 0), reply=lambda _, reply: self.replies.append(reply),
            to_workers=self.sent.append, on_unloaded=self.forgotten.append, clock=lambda: self.now,
        )  # fmt: skip

    def command(
        self,
        op: str,
        name: str,
        path: str = "",
        wait: bool = True,
        world_size: int = 2,
        inplace: bool = False,
    ) -> None:
        command = m.AdapterCommand(f"c{len(self.replies)}", op, name, path, wait, inplace)  # type: ignore[arg-type]
        self.adapters.command(m.AdapterRequest(0, command), world_size, workers_up=True)

    def answer(self, rank: int, name: str) -> None:
        """Worker `rank`'s success for the load of `name` in progress (its load id)."""
        self.adapters.on_loaded(m.AdapterLoaded(rank, name, load_id=self.adapters.loading[name].load_id))

    def last(self) -> tuple[str, str]:
        return self.replies[-1].code, self.replies[-1].message


def test_loads_are_refused_by_name_before_any_worker_is_asked(tmp_path: Path) -> None:
    h = Harness(tmp_path / "list.json", static={"sql": "/a/sql"})
    for name, path, message, param in [
        ("", "/a/x", "lora_name must be a name of 1 to 256 characters", "lora_name"),
        ("x" * 257, "/a/x", "lora_name must be a name of 1 to 256 characters", "lora_name"),
        (
            "a\nb",
            "/a/x",
            "lora_name must not contain control characters (newlines, tabs, bidi overrides...), got 'a\\nb'",
            "lora_name",
        ),
        (
            "a\u2028b",
            "/a/x",
            "lora_name must not contain control characters (newlines, tabs, bidi overrides...), "
            "got 'a\\u2028b'",
            "lora_name",
        ),  # a line separator
        (
            "a\u202eb",
            "/a/x",
            "lora_name must not contain control characters (newlines, tabs, bidi overrides...), "
            "got 'a\\u202eb'",
            "lora_name",
        ),  # a right-to-left override
        ("base", "/a/x", "lora_name 'base' is the base model's name", "lora_name"),
        ("sql", "/a/sql", "lora_name 'sql': that LoRA adapter is already loaded", "lora_name"),
        (
            "new",
            "a/new",
            "lora_path must be an absolute adapter directory or .gguf file, got 'a/new'",
            "lora_path",
        ),
        (
            "new",
            "/a/new\0.gguf",
            "lora_path must not contain a NUL character, got '/a/new\\x00.gguf'",
            "lora_path",
        ),  # answered here, not a worker's ValueError: embedded null byte
    ]:
        h.command("load", name, path)
        assert h.last() == ("invalid_request", message) and h.replies[-1].param == param
    assert h.sent == []
    off = Harness(tmp_path / "off.json", capacity=0)
    off.command("load", "sql", "/a/sql")
    assert off.last() == ("invalid_request", "LoRA adapters are off (lora.max_loras is 0)")
    assert off.replies[-1].param == ""  # the engine's state, not a field of the command


def test_a_load_serves_once_every_rank_has_it_and_a_refusal_names_the_workers_reason(tmp_path: Path) -> None:
    h = Harness(tmp_path / "list.json")
    h.command("load", "sql", "/a/sql")
    assert h.sent == [m.LoadAdapter(m.AdapterSource("sql", "/a/sql"), 1)] and h.replies == []
    h.adapters.on_loaded(m.AdapterLoaded(0, "sql", load_id=1))
    assert h.replies == [] and h.adapters.refusal("sql").startswith("unknown LoRA adapter 'sql'")
    h.adapters.on_loaded(m.AdapterLoaded(1, "sql", load_id=1))
    assert h.last() == ("", "") and h.replies[-1].adapters == {"sql": "/a/sql"}
    assert h.adapters.refusal("sql") == ""
    h.command("load", "bad", "/a/bad")
    h.adapters.on_loaded(m.AdapterLoaded(0, "bad", "adapter 'bad': rank 128 is over lora.max_rank (64)", 2))
    h.adapters.on_loaded(m.AdapterLoaded(1, "bad", load_id=2))
    assert h.last() == ("invalid_request", "adapter 'bad': rank 128 is over lora.max_rank (64)")
    assert h.replies[-1].param == "lora_path"  # what the workers found in the adapter's files
    assert h.sent[-1] == m.UnloadAdapter("bad")  # the rank that did load it forgets it
    h.command("load", "late", "/a/late")
    h.now += LOAD_TIMEOUT_S
    h.adapters.poll()
    assert h.last()[0] == "unavailable" and "did not answer the load in time" in h.last()[1]
    assert h.sent[-1] == m.UnloadAdapter("late")  # a worker still reading it drops it
    # Asked again at once: the answers to the load given up on (load 3) are not this one's (4).
    h.command("load", "late", "/a/late-v2")
    assert h.sent[-1] == m.LoadAdapter(m.AdapterSource("late", "/a/late-v2"), 4)
    h.adapters.on_loaded(m.AdapterLoaded(0, "late", load_id=3))
    h.adapters.on_loaded(m.AdapterLoaded(1, "late", load_id=3))
    assert h.last()[0] == "unavailable" and h.adapters.refusal("late").startswith("unknown LoRA adapter")
    h.adapters.on_loaded(m.AdapterLoaded(0, "late", "adapter 'late': no such file", 4))
    h.adapters.on_loaded(m.AdapterLoaded(1, "late", load_id=4))
    assert h.last() == ("invalid_request", "adapter 'late': no such file")
    h.command("load", "more", "/a/more")
    h.adapters.on_loaded(m.AdapterLoaded(0, "more", load_id=5))
    h.adapters.on_loaded(m.AdapterLoaded(1, "more", load_id=5))
    h.command("load", "third", "/a/third")
    assert h.last() == (
        "invalid_request",
        "2 LoRA adapters are loaded, as many as lora.max_cpu_loras (or lora.max_loras) allows (more, sql); "
        "unload one first",
    )


def test_load_inplace_replaces_an_adapter_no_request_uses(tmp_path: Path) -> None:
    """vLLM's load_inplace (an RL trainer pushing new weights under one name): refused while a
    request uses the adapter, else the old one is unloaded everywhere and the new one loaded."""
    h = Harness(tmp_path / "list.json", static={"sql": "/a/sql"})
    h.command("load", "sql", "/a/sql-v2")
    assert h.last() == ("invalid_request", "lora_name 'sql': that LoRA adapter is already loaded")
    h.users["sql"] = 1
    h.command("load", "sql", "/a/sql-v2", inplace=True)
    assert h.last()[0] == "adapter_in_use" and "used by 1 requests" in h.last()[1] and h.sent == []
    h.users["sql"] = 0
    h.command("load", "sql", "sql-v2", inplace=True)  # a bad request replaces nothing
    assert h.last()[0] == "invalid_request" and h.sent == [] and h.adapters.refusal("sql") == ""
    h.command("load", "sql", "/a/sql-v2", inplace=True)
    assert h.sent == [m.UnloadAdapter("sql"), m.LoadAdapter(m.AdapterSource("sql", "/a/sql-v2"), 1)]
    assert h.forgotten == ["sql"] and h.adapters.refusal("sql").startswith("unknown LoRA adapter")
    for rank in (0, 1):
        h.answer(rank, "sql")
    assert h.last() == ("", "") and h.replies[-1].adapters == {"sql": "/a/sql-v2"}
    # Its requests' prefix-cache blocks are kept apart from the first load's (Request.hash_root).
    assert h.adapters.load_count("sql") == 1 and h.adapters.load_count("never") == 0
    one, two = (
        Request("r", 0, [1, 2], m.SamplingParams(adapter="sql"), adapter_load=load) for load in (0, 1)
    )
    assert one.hash_root != two.hash_root
    h.command("load", "new", "/a/new", inplace=True)  # nothing to replace: an ordinary load
    assert h.sent[-1] == m.LoadAdapter(m.AdapterSource("new", "/a/new"), 2)


def test_an_unload_refuses_or_waits_for_the_requests_using_its_adapter(tmp_path: Path) -> None:
    h = Harness(tmp_path / "list.json", static={"sql": "/a/sql", "chat": "/a/chat"})
    h.command("unload", "nope")
    assert h.last() == ("model_not_found", "the LoRA adapter 'nope' is not loaded; loaded: ['chat', 'sql']")
    h.users["sql"] = 2
    h.command("unload", "sql", wait=False)
    assert h.last() == (
        "adapter_in_use",
        "the LoRA adapter 'sql' is used by 2 requests (\"wait\": true waits for them)",
    )
    num_replies = len(h.replies)
    h.command("unload", "sql")  # waits
    assert len(h.replies) == num_replies and "being unloaded" in h.adapters.refusal("sql")
    h.users["sql"] = 0
    h.adapters.poll()
    assert h.last() == ("", "") and h.replies[-1].adapters == {"chat": "/a/chat"}
    assert h.sent[-1] == m.UnloadAdapter("sql") and h.forgotten == ["sql"]
    h.users["chat"] = 1
    h.command("unload", "chat")
    h.now += 10.0
    h.adapters.poll()
    assert h.last() == (
        "adapter_in_use",
        "the LoRA adapter 'chat' is still used by 1 requests after lora.unload_wait_s (10s); it stays loaded",
    )
    assert h.adapters.refusal("chat") == ""


def test_a_reload_that_replaces_an_adapter_in_use_at_full_capacity_loads_the_new_one_after(
    tmp_path: Path,
) -> None:
    """A hot reload that lists chat instead of sql, with every place taken (sql, and tool loaded
    through the endpoint) and a request on sql: the unload of sql waits for the request, and the
    load of chat waits for the room it frees, instead of being refused for want of it."""
    h = Harness(tmp_path / "list.json", static={"sql": "/a/sql"})
    h.command("load", "tool", "/a/tool")
    for rank in (0, 1):
        h.answer(rank, "tool")
    h.users["sql"] = 1
    num_replies = len(h.replies)
    h.adapters.reload({"sql": "/a/sql"}, {"chat": "/a/chat"}, world_size=2, workers_up=True)
    assert len(h.replies) == num_replies, h.replies[num_replies:]  # nothing refused
    assert not any(isinstance(c, m.LoadAdapter) and c.adapter.name == "chat" for c in h.sent)
    assert h.adapters.has_pending
    h.users["sql"] = 0
    h.adapters.poll()
    assert h.forgotten == ["sql"]
    assert h.sent[-2:] == [m.UnloadAdapter("sql"), m.LoadAdapter(m.AdapterSource("chat", "/a/chat"), 2)]
    for rank in (0, 1):
        h.answer(rank, "chat")
    assert h.adapters.loaded == {"tool": "/a/tool", "chat": "/a/chat"} and not h.adapters.has_pending
    # One whose unload gives up (still in use after lora.unload_wait_s) leaves the load to be
    # refused for want of room, as a load without it is: the reply is logged.
    h.users["chat"] = 1
    h.adapters.reload({"chat": "/a/chat"}, {"sql": "/a/sql"}, world_size=2, workers_up=True)
    h.now += 10.0
    h.adapters.poll()
    assert [reply.code for reply in h.replies[-2:]] == ["adapter_in_use", "invalid_request"]
    assert "unload one first" in h.replies[-1].message and not h.adapters.has_pending


def test_a_restarted_scheduler_reads_back_the_list(tmp_path: Path) -> None:
    h = Harness(tmp_path / "list.json", static={"sql": "/a/sql"})
    h.command("load", "chat", "/a/chat", world_size=1)
    h.answer(0, "chat")
    h.command("unload", "sql")
    again = Harness(tmp_path / "list.json", static={"sql": "/a/sql"})
    assert again.adapters.loaded == {"chat": "/a/chat"}
    assert again.adapters.sources() == [m.AdapterSource("chat", "/a/chat")]


def test_slots_swap_least_recently_used_never_under_a_running_request() -> None:
    slots = LoraResidency(2)
    assert slots.acquire("a") == 0 and slots.acquire("a") == 0
    assert slots.acquire("b") == -1  # one swap per step
    slots.next_step()
    assert slots.acquire("b") == 1
    slots.next_step()
    assert slots.acquire("c") == -1  # both slots have running requests
    slots.release(1)  # b's request leaves at step 2
    slots.next_step()
    slots.release(0)
    slots.release(0)  # a's leave at step 3: b's slot is the least recently used
    slots.next_step()
    assert slots.acquire("c") == 1 and slots.names == ["a", "c"] and slots.num_swaps == 3
    slots.forget("a")
    assert slots.names == ["", "c"]


def test_adapters_of_waiting_requests_are_copied_in_ahead_never_over_one_in_use() -> None:
    """`prefetch`: the adapters of waiting requests go into slots no running request uses, one a
    step, never over an adapter that a request ahead of theirs wants; the step that admits them
    finds them resident (no swap). The header names a slot for the step's rows only where running
    requests use it, and the copies to start in lora_prefetch."""
    slots = LoraResidency(2)
    assert slots.acquire("a") == 0
    slots.prefetch(["", "b", "c"])  # the base model's request needs none; one copy a step
    assert slots.names == ["a", "b"] and slots.header() == (("a", ""), ("", "b"))
    assert (slots.num_swaps, slots.num_prefetches) == (2, 1)
    slots.next_step()
    assert slots.header() == (("a", ""), ())
    slots.prefetch(["b", "c"])  # b's slot is kept for b, a's is in use: c waits
    assert slots.names == ["a", "b"] and slots.header()[1] == ()
    assert slots.acquire("b") == 1 and slots.num_swaps == 2  # resident: no swap on the step's path
    slots.release(0)  # a's request leaves
    slots.next_step()
    slots.prefetch(["a", "c"])  # a is wanted first: c may not take its slot
    assert slots.header() == (("", "b"), ())
    slots.release(1)  # b's request leaves
    slots.next_step()
    slots.prefetch(["c"])  # into the least recently used free slot: a's
    assert slots.names == ["c", "b"] and slots.header() == ((), ("c", ""))
    slots.next_step()
    assert slots.acquire("d") == 1  # c, copied in after b's request left, counts as used later
    assert slots.names == ["c", "d"] and (slots.num_swaps, slots.num_prefetches) == (4, 2)
    slots.prefetch(["e"])  # over c: its slot is free, and no waiting request ahead of e wants c
    assert slots.names == ["e", "d"]
    slots.forget("e")  # unloaded in this step: its copy is not announced
    assert slots.names == ["", "d"] and slots.header() == (("", "d"), ())


def test_a_spare_slot_takes_the_next_adapter_while_every_other_slot_runs() -> None:
    """lora.max_loras 1 with adapters beyond it: two slots, one adapter running at a time. While
    a's request runs, b's adapter goes into the spare ahead of its step, and that step admits it
    with no copy on its path; a's slot is the spare then. Without the spare slot, b's copy waits
    for a's request to leave and lands on the admitting step's path."""
    slots = LoraResidency(1, 2)
    assert slots.acquire("a") == 0
    slots.next_step()
    assert slots.acquire("b") == -1  # one adapter runs at a time, a slot free or not
    slots.prefetch(["b"])
    assert slots.names == ["a", "b"] and slots.header() == (("a", ""), ("", "b"))
    slots.next_step()
    assert slots.acquire("b") == -1  # resident, but a's request still runs
    slots.release(0)
    slots.next_step()
    swaps = slots.num_swaps
    assert slots.acquire("b") == 1 and slots.num_swaps == swaps
    slots.prefetch(["c"])  # into a's slot, the spare now
    assert slots.names == ["c", "b"] and slots.header() == (("", "b"), ("c", ""))

    alone = LoraResidency(1)
    assert alone.acquire("a") == 0
    alone.next_step()
    alone.prefetch(["b"])
    assert alone.names == ["a"] and alone.header()[1] == ()
    alone.release(0)
    alone.next_step()
    swaps = alone.num_swaps
    assert alone.acquire("b") == 0 and alone.num_swaps == swaps + 1  # copied on the step's path
    with pytest.raises(ValueError, match="1 LoRA slots cannot run 2 adapters at once"):
        LoraResidency(2, 1)


@pytest.mark.parametrize(
    ("max_loras", "max_cpu_loras", "num_slots"), [(0, 0, 0), (2, 0, 2), (2, 2, 2), (2, 5, 3), (1, 2, 2)]
)
def test_the_workers_keep_a_spare_slot_only_where_adapters_outnumber_the_slots(
    max_loras, max_cpu_loras, num_slots
):
    lora = load_config(None, [f"lora.max_loras={max_loras}", f"lora.max_cpu_loras={max_cpu_loras}"]).lora
    assert lora.num_slots == num_slots


def test_adapters_in_host_memory_with_adapters_off_are_refused() -> None:
    with pytest.raises(
        ConfigError, match=r"lora.max_cpu_loras \(4\) with lora.max_loras 0: adapters are off"
    ):
        load_config(None, ["lora.max_cpu_loras=4"])
