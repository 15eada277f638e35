"""The replies held for a slow client (services/tokenizer/backlog.py), without sockets: contiguous
deltas of one request become one, in order with everything else, and a send refused halfway keeps
the rest for the next try."""

from __future__ import annotations

from ipc import messages as m
from ipc.sockets import Sent
from services.tokenizer.backlog import Backlog


def delta(rid: str, index: int, text: str, finish: str | None = None, **fields: object) -> m.Delta:
    ids = list(range(index, index + len(text)))  # one token per character, so offsets match
    return m.Delta(rid, index, index, text, m.pack_ids(ids), finish_reason=finish, **fields)


class Socket:
    """Takes `room` replies, then refuses (FULL), or finds the client gone."""

    def __init__(self, room: int, gone: bool = False) -> None:
        self.room, self.gone, self.sent = room, gone, []

    def send(self, reply: m.ClientReply) -> Sent:
        if self.gone:
            return Sent.GONE
        if len(self.sent) >= self.room:
            return Sent.FULL
        self.sent.append(reply)
        return Sent.OK


def test_contiguous_deltas_of_a_request_are_sent_as_one_in_order():
    usage = m.Usage(7, 1)
    backlog = Backlog(delta("a", 0, "he", usage=usage, logprobs=b"\0" * 8), now=0.0)
    backlog.add(delta("b", 0, "x"))
    backlog.add(delta("a", 2, "ll", logprobs=b"\1" * 8))
    probe = m.HealthReply(0, True, "model", 2, 100, ["gone"])
    backlog.add(probe)
    backlog.add(delta("a", 4, "o", "length", usage=m.Usage(7, 5), logprobs=b"\2" * 4))
    assert len(backlog) == 3
    socket = Socket(room=10)
    assert backlog.flush(socket.send, now=1.0) is Sent.OK
    a, b, health = socket.sent
    assert (a.request_id, a.token_index, a.char_offset, a.text) == ("a", 0, 0, "hello")
    assert m.unpack_ids(a.token_ids).tolist() == [0, 1, 2, 3, 4]
    assert a.logprobs == b"\0" * 8 + b"\1" * 8 + b"\2" * 4
    assert (a.finish_reason, a.usage) == ("length", m.Usage(7, 5))
    assert b == delta("b", 0, "x") and health == probe
    assert len(backlog) == 0 and backlog.progress_at == 1.0


def test_a_final_delta_or_a_gap_is_never_joined():
    backlog = Backlog(delta("a", 0, "ab", "abort"), now=0.0)
    backlog.add(delta("a", 5, "fg"))  # the same id again: a resubmission that resumes at 5
    backlog.add(delta("a", 8, "i"))  # a gap: kept apart, never merged over it
    socket = Socket(room=10)
    assert backlog.flush(socket.send, now=0.0) is Sent.OK
    assert [(d.token_index, d.text, d.finish_reason) for d in socket.sent] == [
        (0, "ab", "abort"),
        (5, "fg", None),
        (8, "i", None),
    ]


def test_a_refused_send_keeps_the_rest_and_later_deltas_still_join():
    backlog = Backlog(delta("a", 0, "a"), now=0.0)
    backlog.add(delta("b", 0, "b"))
    socket = Socket(room=1)
    assert backlog.flush(socket.send, now=2.0) is Sent.FULL
    assert backlog.progress_at == 2.0 and len(backlog) == 1
    backlog.add(delta("a", 1, "c"))  # a's held delta went out: this one waits behind b's
    backlog.add(delta("b", 1, "d", "stop"))  # b's is still held: it joins it
    socket.room = 10
    assert backlog.flush(socket.send, now=3.0) is Sent.OK
    assert [(d.request_id, d.token_index, d.text) for d in socket.sent] == [
        ("a", 0, "a"),
        ("b", 0, "bd"),
        ("a", 1, "c"),
    ]
    assert Backlog(delta("a", 0, "a"), now=0.0).flush(Socket(room=10, gone=True).send, now=1.0) is Sent.GONE
