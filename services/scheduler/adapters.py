"""The LoRA adapters an engine group serves, owned by its scheduler (docs/lora.md "Loading at run
time"): the adapters loaded, the loads waiting for every worker's answer, and the unloads waiting
for the requests that use their adapter. Which slot holds which adapter is another matter
(lora_residency.py).

A load asks every worker to check the adapter and keep it in host memory; the adapter serves once
all have, and a refusal answers with the worker's message. An unload waits (up to
lora.unload_wait_s) or refuses while requests use the adapter, so a running request's adapter
never goes away under it. The list is written to a file of the run dir at each change, so that a
restarted scheduler serves the same adapters, and every worker's hello is answered with it, so
that a restarted worker loads them.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import msgspec

from ipc import messages as m
from ipc.config import LORA_OFF, adapter_name_problem, adapter_path_problem

LOAD_TIMEOUT_S = 120.0  # every worker answers a load within this, or it fails (a worker lost meanwhile)

ReplyTo = tuple[int, str]  # the tokenizer and its id of the command
RELOAD: ReplyTo = (-1, "lora.adapters reload")  # a hot reload's commands: their outcome is logged


@dataclass
class PendingLoad:
    reply_to: ReplyTo
    adapter: m.AdapterSource
    load_id: int  # what the workers' answers must carry: an answer to an earlier load is stale
    waiting: set[int]  # the ranks that have not answered
    deadline: float
    error: str = ""


@dataclass
class PendingUnload:
    reply_to: ReplyTo
    name: str
    deadline: float


class Adapters:
    """The group's adapters and its commands in progress: at most `capacity` loaded (lora's
    max_cpu_loras, or max_loras). `users(name)` counts the requests of the group that use an
    adapter; `reply` answers a command; `to_workers` sends every worker a LoadAdapter or
    UnloadAdapter; `on_unloaded` is told an adapter is gone."""

    def __init__(
        self,
        capacity: int,
        static: dict[str, str],
        state_file: Path,
        unload_wait_s: float,
        base_model: str,
        users: Callable[[str], int],
        reply: Callable[[int, m.AdapterReply], None],
        to_workers: Callable[[m.LoadAdapter | m.UnloadAdapter], None],
        on_unloaded: Callable[[str], None],
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.capacity, self.state_file, self.unload_wait_s = capacity, state_file, unload_wait_s
        self.base_model = base_model
        self.users, self.reply, self.to_workers, self.clock = users, reply, to_workers, clock
        self.on_unloaded = on_unloaded
        saved = self._saved()
        self.loaded: dict[str, str] = dict(static) if saved is None else saved  # name -> path
        self.loading: dict[str, PendingLoad] = {}  # by adapter name
        self.unloading: dict[str, PendingUnload] = {}  # by adapter name
        self.num_loads = 0  # loaded at run time, since this scheduler started
        self.num_load_commands = 0  # LoadAdapters sent: the next one's load_id
        self.loads_of: dict[str, int] = {}  # name -> how many times loaded at run time (0: static)
        # A hot reload's loads that wait for room its unloads (waiting for their requests) will
        # make, with the reload's world size and whether the workers were up.
        self.reload_loads: list[m.AdapterSource] = []
        self.reload_workers: tuple[int, bool] = (0, False)

    def _saved(self) -> dict[str, str] | None:
        """The list a scheduler of this group wrote before it restarted, if any."""
        with contextlib.suppress(OSError, msgspec.DecodeError, msgspec.ValidationError):
            return msgspec.json.decode(self.state_file.read_bytes(), type=dict[str, str])
        return None

    def _save(self) -> None:
        """Written whole and renamed into place, so that a scheduler killed meanwhile leaves the
        old table or the new one. A run dir this host cannot write (a stage placed elsewhere)
        keeps the table in memory only: a restarted scheduler then serves lora.adapters."""
        tmp = self.state_file.with_name(self.state_file.name + ".tmp")
        with contextlib.suppress(OSError):
            tmp.write_bytes(msgspec.json.encode(self.loaded))
            tmp.replace(self.state_file)

    # -- what requests see ---------------------------------------------------------------------

    def sources(self) -> list[m.AdapterSource]:
        return [m.AdapterSource(name, path) for name, path in self.loaded.items()]

    def load_count(self, name: str) -> int:
        """Which load of `name` serves now: the prefix cache keeps each load's blocks apart, since
        a name unloaded and loaded again (load_inplace, or an unload and a load) may hold other
        weights. Counted since this scheduler started, as its cache is."""
        return self.loads_of.get(name, 0)

    def refusal(self, name: str) -> str:
        """Why a new request may not use adapter `name` ("" when it may)."""
        if name not in self.loaded:
            return f"unknown LoRA adapter {name!r}; served: {sorted(self.loaded)}"
        if name in self.unloading:
            return f"the LoRA adapter {name!r} is being unloaded"
        return ""

    # -- commands ------------------------------------------------------------------------------

    def command(self, request: m.AdapterRequest, world_size: int, workers_up: bool) -> None:
        command, reply_to = request.command, (request.tokenizer_id, request.command.request_id)
        if command.op == "list":
            self._answer(reply_to)
        elif command.op == "load":
            self._load(reply_to, command, world_size, workers_up)
        else:
            self._unload(reply_to, command)

    def reload(self, old: dict[str, str], new: dict[str, str], world_size: int, workers_up: bool) -> None:
        """A hot reload changed lora.adapters from `old` to `new`: the adapters it adds are loaded
        and those it removes unloaded (waiting for their requests), as the endpoints do; adapters
        loaded through the endpoints and never listed stay. An added adapter for which only the
        removed ones make room is loaded once they are unloaded: an edit that replaces an adapter
        in use at full capacity is not refused for want of the room it frees."""
        for name in old.keys() - new.keys():
            if name in self.loaded:
                self._unload(RELOAD, m.AdapterCommand(RELOAD[1], "unload", name))
        # Loads an earlier reload left waiting go on if this edit still lists them.
        loads = [source for source in self.reload_loads if new.get(source.name) == source.path]
        for name, path in new.items():
            if old.get(name) == path:
                continue
            if name in self.loaded and self.loaded[name] != path:
                message = f"the LoRA adapter {name!r} moved to {path!r}: unload it, then load it again"
                self._answer(RELOAD, "invalid_request", message)
            elif name not in self.loaded:
                loads.append(m.AdapterSource(name, path))
        self.reload_loads, self.reload_workers = loads, (world_size, workers_up)
        self._start_reload_loads()

    def _start_reload_loads(self) -> None:
        """Start the reload's loads there is room for; while a reload's unload waits for its
        requests, the rest wait for the room it will free (one that gives up leaves them to be
        refused, and logged, as a load without room is)."""
        unloads_pending = any(pending.reply_to == RELOAD for pending in self.unloading.values())
        waiting = []
        for source in self.reload_loads:
            if unloads_pending and len(self.loaded) + len(self.loading) >= self.capacity:
                waiting.append(source)
                continue
            command = m.AdapterCommand(RELOAD[1], "load", source.name, source.path)
            self._load(RELOAD, command, *self.reload_workers)
        self.reload_loads = waiting

    def _answer(self, reply_to: ReplyTo, code: str = "", message: str = "", param: str = "") -> None:
        self.reply(reply_to[0], m.AdapterReply(reply_to[1], code, message, dict(self.loaded), param))

    def _load(self, reply_to: ReplyTo, command: m.AdapterCommand, world_size: int, workers_up: bool) -> None:
        name, path = command.name, command.path
        replaces = command.inplace and name in self.loaded
        param, refusal = self._load_refusal(name, path, replaces)
        if refusal:
            self._answer(reply_to, "invalid_request", refusal, param)
            return
        if not workers_up:
            self._answer(reply_to, "unavailable", "the engine's workers are starting; try again")
            return
        if replaces:
            users = self.users(name)
            if users or name in self.unloading:
                message = (
                    f"the LoRA adapter {name!r} is used by {users} requests; load_inplace replaces it once "
                    "none does (a running request's adapter never changes)"
                    if users
                    else f"the LoRA adapter {name!r} is being unloaded"
                )
                self._answer(reply_to, "adapter_in_use", message, "lora_name")
                return
            self._forget(name)  # then loaded again: a replacement the workers refuse leaves it unloaded
        adapter = m.AdapterSource(name, path)
        self.num_load_commands += 1
        load_id = self.num_load_commands
        self.loading[name] = PendingLoad(
            reply_to, adapter, load_id, set(range(world_size)), self.clock() + LOAD_TIMEOUT_S
        )
        self.to_workers(m.LoadAdapter(adapter, load_id))

    def _load_refusal(self, name: str, path: str, replaces: bool = False) -> tuple[str, str]:
        """Why a load is refused, as (the field it is about, or "" for the engine's state; the
        message), or ("", "") when it may go ahead; one that `replaces` the loaded adapter of its
        name neither counts that adapter nor finds the name taken."""
        if self.capacity == 0:
            return "", LORA_OFF
        if problem := adapter_name_problem(name):
            return "lora_name", f"lora_name {problem}"
        if name == self.base_model:
            return "lora_name", f"lora_name {name!r} is the base model's name"
        if name in self.loading or (name in self.loaded and not replaces):
            return "lora_name", f"lora_name {name!r}: that LoRA adapter is already loaded"
        if problem := adapter_path_problem(path):
            return "lora_path", f"lora_path {problem}"
        if len(self.loaded) - replaces + len(self.loading) >= self.capacity:
            return "", (
                f"{self.capacity} LoRA adapters are loaded, as many as lora.max_cpu_loras (or lora.max_loras) "
                f"allows ({', '.join(sorted(self.loaded))}); unload one first"
            )
        return "", ""

    def on_loaded(self, answer: m.AdapterLoaded) -> None:
        """A worker's answer to a load: the adapter serves once every rank has it. An answer to
        a load given up on (timed out, then asked again under the same name) is not this one's."""
        pending = self.loading.get(answer.name)
        if pending is None or pending.load_id != answer.load_id:
            return
        pending.waiting.discard(answer.rank)
        pending.error = pending.error or answer.error
        if pending.waiting:
            return
        del self.loading[answer.name]
        if pending.error:
            self.to_workers(m.UnloadAdapter(answer.name))  # the ranks that did load it
            self._answer(pending.reply_to, "invalid_request", pending.error, "lora_path")
            return
        self.loaded[answer.name] = pending.adapter.path
        self.num_loads += 1
        self.loads_of[answer.name] = self.loads_of.get(answer.name, 0) + 1
        self._save()
        self._answer(pending.reply_to)

    def _unload(self, reply_to: ReplyTo, command: m.AdapterCommand) -> None:
        name = command.name
        if name not in self.loaded:
            message = f"the LoRA adapter {name!r} is not loaded; loaded: {sorted(self.loaded)}"
            self._answer(reply_to, "model_not_found", message)
            return
        if name in self.unloading:
            self._answer(reply_to, "adapter_in_use", f"the LoRA adapter {name!r} is being unloaded already")
            return
        users = self.users(name)
        if users and not command.wait:
            message = f'the LoRA adapter {name!r} is used by {users} requests ("wait": true waits for them)'
            self._answer(reply_to, "adapter_in_use", message)
            return
        self.unloading[name] = PendingUnload(reply_to, name, self.clock() + self.unload_wait_s)
        self.poll()

    def poll(self) -> None:
        """Finish the unloads whose adapter is no longer used, give up on those past their wait,
        and fail the loads a worker never answered."""
        now = self.clock()
        for name, pending in list(self.unloading.items()):
            users = self.users(name)
            if users and now < pending.deadline:
                continue
            del self.unloading[name]
            if users:
                message = (
                    f"the LoRA adapter {name!r} is still used by {users} requests after "
                    f"lora.unload_wait_s ({self.unload_wait_s:g}s); it stays loaded"
                )
                self._answer(pending.reply_to, "adapter_in_use", message)
                continue
            self._forget(name)
            self._answer(pending.reply_to)
        if any(now >= pending.deadline for pending in self.loading.values()):
            self.fail_loads("the engine's workers did not answer the load in time")
        if self.reload_loads:
            self._start_reload_loads()

    def _forget(self, name: str) -> None:
        """Unload `name`, which no request uses, here and in every worker."""
        del self.loaded[name]
        self._save()
        self.on_unloaded(name)
        self.to_workers(m.UnloadAdapter(name))

    def fail_loads(self, reason: str) -> None:
        """The workers were lost, or did not answer in time: the loads in progress fail (a
        restarted worker loads only the adapters of the table, which they never joined), and a
        worker still reading one drops it."""
        for name, pending in self.loading.items():
            self._answer(pending.reply_to, "unavailable", f"{reason}; try again")
            self.to_workers(m.UnloadAdapter(name))
        self.loading.clear()

    @property
    def has_pending(self) -> bool:
        return bool(self.loading or self.unloading or self.reload_loads)
