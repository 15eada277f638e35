"""The replies a slow client's socket did not take yet (docs/architecture.md, "Back-pressure to
clients").

A client that reads slowly (the gateway's event loop busy, an SDK user who works on each delta
before the next) fills its ZeroMQ queue; the tokenizer's ROUTER then refuses its replies
(`Sent.FULL`). They wait here, in order, and go out once the queue takes them again. The streamed
deltas of one request that wait side by side become one delta, so what is held grows with the
text of the requests in flight (bounded by their max_tokens), not with the number of steps, and
the client gets fewer, larger deltas once it reads. Each delta carries its absolute positions
(invariant 2), so joining contiguous ones keeps the output exactly once. Light: no torch.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable

import msgspec

from ipc import messages as m
from ipc.sockets import Sent


class _Held:
    """One held reply; a streamed delta collects the ones that follow it contiguously, joined only
    when it is sent (joining at each add would copy the held text once per token)."""

    __slots__ = (
        "first",
        "last",
        "logprobs",
        "num_chars",
        "num_tokens",
        "reply",
        "texts",
        "token_ids",
        "tops",
    )

    def __init__(self, reply: m.ClientReply) -> None:
        self.reply = reply
        if isinstance(reply, m.Delta):
            self.first = self.last = reply
            self.texts, self.token_ids, self.logprobs = [reply.text], [reply.token_ids], [reply.logprobs]
            self.tops = list(reply.top_logprobs)
            self.num_tokens, self.num_chars = len(reply.token_ids) // 4, len(reply.text)

    def join(self, delta: m.Delta) -> bool:
        """Take `delta` into this held delta when it continues it; False when it does not (this
        one is final, or there is a gap between them: a new request under the same id) or either
        is a report of prompt progress and the other output (the first output's fields come with
        it). A newer report replaces a held one: a slow client gets the latest, not one a chunk."""
        if self.last.prompt_progress is not None and delta.prompt_progress is not None:
            self.reply = self.first = self.last = delta
            return True
        if (
            self.last.finish_reason is not None
            or self.last.prompt_progress is not None
            or delta.prompt_progress is not None
            or delta.token_index != self.first.token_index + self.num_tokens
            or delta.char_offset != self.first.char_offset + self.num_chars
        ):
            return False
        self.last = delta
        self.texts.append(delta.text)
        self.token_ids.append(delta.token_ids)
        self.logprobs.append(delta.logprobs)
        self.tops += delta.top_logprobs
        self.num_tokens += len(delta.token_ids) // 4
        self.num_chars += len(delta.text)
        return True

    def message(self) -> m.ClientReply:
        if isinstance(self.reply, m.Delta) and self.last is not self.first:
            # The first delta's prompt logprobs (token 0's); the last one's finish, usage (the
            # final count), parsed tools and embedding; everything between, joined.
            self.reply = msgspec.structs.replace(
                self.last,
                token_index=self.first.token_index,
                char_offset=self.first.char_offset,
                text="".join(self.texts),
                token_ids=b"".join(self.token_ids),
                logprobs=b"".join(self.logprobs),
                top_logprobs=self.tops,
                usage=self.last.usage or self.first.usage,
                prompt_logprobs=self.first.prompt_logprobs,
            )
            # Joined once: a send refused again does not join it again.
            self.first = self.last = self.reply
            self.texts, self.token_ids, self.logprobs = (
                [self.reply.text],
                [self.reply.token_ids],
                [self.reply.logprobs],
            )
            self.tops = list(self.reply.top_logprobs)
        return self.reply


class Backlog:
    """The held replies of one client, oldest first. Replies of other kinds (errors, health
    answers) wait in line with the deltas: a probe's answer must not overtake the final delta of a
    request it no longer lists (ipc/messages.py HealthReply)."""

    def __init__(self, reply: m.ClientReply, now: float) -> None:
        self.replies: deque[_Held] = deque()
        self.open: dict[str, _Held] = {}  # by client request id: its last held delta, still growing
        self.progress_at = now  # when the client's socket last took a reply (or holding began)
        self.add(reply)

    def __len__(self) -> int:
        return len(self.replies)

    def add(self, reply: m.ClientReply) -> None:
        if isinstance(reply, m.Delta):
            held = self.open.get(reply.request_id)
            if held is not None and held.join(reply):
                return
            held = _Held(reply)
            self.open[reply.request_id] = held
        else:
            held = _Held(reply)
        self.replies.append(held)

    def flush(self, send: Callable[[m.ClientReply], Sent], now: float) -> Sent:
        """Send the held replies in order until the socket refuses one: Sent.OK when none is left,
        FULL when the rest must wait, GONE when the client is gone."""
        while self.replies:
            held = self.replies[0]
            sent = send(held.message())
            if sent is not Sent.OK:
                return sent
            self.progress_at = now
            self.replies.popleft()
            if isinstance(held.reply, m.Delta) and self.open.get(held.reply.request_id) is held:
                del self.open[held.reply.request_id]
        return Sent.OK
