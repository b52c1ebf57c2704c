"""The ring's transports: how a chunk crosses from a rank to its right neighbour.

The schedule (:func:`commlab.regimes.ring.run_schedule`) is written once and knows nothing of
bytes on wires. Each link between neighbours has two halves, chosen per link (``transport=auto``
may join a rank to its left over TCP and to its right through shared memory):

- an **outbox** on the sending rank: ``send(t, j)`` hands over chunk ``j`` of what step ``t``
  sends (it never waits for the neighbour: what cannot leave yet is queued), ``release(t, j)``
  returns once that chunk's bytes are no longer read from the caller's tensor (called before the
  rank writes into a region it sent: the two-rank swap), ``finish()`` once no send reads the
  tensor any more;
- an **inbox** on the receiving rank: ``reduce(t, j, release)`` waits for chunk ``j`` of step
  ``t`` from the left and adds it into the tensor (calling ``release`` first, when given) through
  the collective's ``add_array``/``add_tensor`` (a plain sum, or :class:`HopCastCollective`'s
  float32 partials), ``store(t, j)`` writes it there instead.

``begin(c)`` starts a collective on either half. Every wait is bounded by the link's timeout
and raises a :mod:`commlab.base.errors` type with ``peer`` (the neighbour's rank) and ``op``
(``"receive"`` or ``"send"``). Framing and validation stay below this line: the fixed chunk
header (:func:`commlab.transport.wire.chunk_header`) is compared with the one the receiver expects,
whatever carries it.

An outbox's other calls (``pending``, ``pump``, ``fileno``, ``poll_drop``) are for the waits of
this rank's inbox, with defaults that do nothing: only a kind whose sends can queue (shared memory)
or whose neighbour's drop shows apart from its receives (zmq) overrides them.

Transports, each made by a link kind (:class:`commlab.regimes.ring.LinkKind`): :class:`ZmqOutbox`/
:class:`ZmqInbox` (pyzmq PUSH/PULL over tcp or ipc), :class:`TorchOutbox`/:class:`TorchInbox`
(torch.distributed isend/irecv), and :class:`ShmOutbox`/:class:`ShmInbox` (one host: shared memory, see below).

Shared memory (``transport=shm``)::

    rank r's segment (/dev/shm, owned by r)          a Unix SEQPACKET connection r -> r+1
    [ header | slot 0 | slot 1 | slot 2 | slot 3 ]   r -> r+1: READY  <40-byte chunk header>
          ^ r copies chunk k into slot k % 4          r+1 -> r: TAKEN  <k + 1>
          v r+1 adds (or copies) straight out of it, then says TAKEN

Each byte is copied once in (from the sender's tensor into its slot) and once out (added into,
or copied into, the receiver's tensor), against the kernel's two copies per socket transfer.
A slot is reused once its TAKEN has come back; sends that find no free slot wait in a queue
that every wait of the rank drains (the schedule sends a whole segment's chunks at once, so a
blocking send could deadlock the ring). The connection carries the signals and tells a dead
neighbour at once: the kernel closes a killed process's end (EOF, or POLLHUP).
"""

from __future__ import annotations

import abc
import collections
import select
import socket
import struct
import time
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Callable

import numpy as np
import torch
import zmq

from commlab.base import errors
from commlab.transport import wire
from commlab.base.errors import CommError, CommTimeout, PeerLost, ProtocolError
from commlab.transport.sockets import Link

Step = tuple[int, int, bool]  # (segment sent, segment received, whether the received one is added)


@dataclass
class Collective:
    """One collective as the halves see it: the tensor, its number and its plan. The halves send and
    store ``work``'s bytes; a chunk received in a step that adds goes through :meth:`add_array` or
    :meth:`add_tensor` (the arithmetic lives here, once, not in each transport)."""

    work: torch.Tensor  # flat, contiguous; what travels: summed (or stored) in place
    seq: int  # collective number on this ring (every rank counts the same)
    bounds: list[int]  # segment starts, then numel
    K: int  # chunks per segment
    plan: tuple[Step, ...]

    def __post_init__(self):
        self.itemsize = self.work.element_size()
        self.steps = len(self.plan)
        self._array: np.ndarray | None = None

    def add_array(self, lo: int, hi: int, raw: np.ndarray) -> None:
        """Add the chunk of elements [lo, hi) that arrived as ``raw`` (uint8, a view of the transport's buffer:
        not kept). numpy: a tenth of torch's per-call overhead on small chunks."""
        if self._array is None:
            self._array = self.work.numpy()
        dst = self._array[lo:hi]
        np.add(dst, raw.view(dst.dtype), out=dst)

    def add_tensor(self, lo: int, hi: int, incoming: torch.Tensor) -> None:
        """Add the chunk of elements [lo, hi) that arrived as ``incoming`` (``work``'s dtype; not kept)."""
        self.work[lo:hi].add_(incoming)

    def chunk(self, seg: int, j: int) -> tuple[int, int]:
        lo, length = self.bounds[seg], self.bounds[seg + 1] - self.bounds[seg]
        return lo + length * j // self.K, lo + length * (j + 1) // self.K

    def sent(self, t: int, j: int) -> tuple[int, int]:
        return self.chunk(self.plan[t][0], j)

    def received(self, t: int, j: int) -> tuple[int, int]:
        return self.chunk(self.plan[t][1], j)

    def header(self, sender: int, t: int, j: int, lo: int, hi: int) -> bytes:
        return wire.chunk_header(sender, self.seq, t, j, lo, hi - lo, self.work.dtype)


@dataclass
class HopCastCollective(Collective):
    """A sum that travels narrow (float16, bfloat16: ``work``, the caller's tensor) and adds in float32, hop
    by hop: each chunk received in a step that adds goes into ``acc`` (float32 partial sums, started from
    this rank's own values) and that partial, rounded once to the wire dtype, replaces the chunk in
    ``work``, which is what the next step forwards; at the segment's owner (the last step that adds) it is
    the result, which the steps that store circulate as it is. So every rank ends with the same bits, and
    each partial sum is rounded once per hop (N-1 roundings on the way to an element's owner)."""

    acc: torch.Tensor = field(init=False)  # float32 partial sums, from this rank's own values

    def __post_init__(self):
        super().__post_init__()
        self.acc = self.work.to(torch.float32)

    def add_array(self, lo: int, hi: int, raw: np.ndarray) -> None:
        self.add_tensor(lo, hi, torch.from_numpy(raw).view(self.work.dtype))

    def add_tensor(self, lo: int, hi: int, incoming: torch.Tensor) -> None:
        partial = self.acc[lo:hi]
        partial.add_(incoming)
        self.work[lo:hi].copy_(partial)


class Half(abc.ABC):
    """What both halves share: whose rank, which neighbour (``peer``, named ``who`` in errors), the collective
    in progress (``begin``), and ``close``."""

    c: Collective  # the collective in progress (set by begin)

    def __init__(self, me: int, peer: int, who: str, timeout: float):
        self.me, self.peer, self.who, self.timeout = me, peer, who, timeout

    def begin(self, c: Collective) -> None:
        self.c = c

    def close(self, linger_s: float = 0.0) -> None:
        """Release the link (``linger_s``: how long an outbox may wait for the neighbour to take what it sent)."""


class Outbox(Half):
    """The sending half. The schedule calls :meth:`send`, :meth:`release` and :meth:`finish` (see the module's
    docstring for when they block). The rest is for the waits of this rank's inbox, and only a kind whose
    sends can queue (shared memory) or whose neighbour's drop shows apart from its receives (zmq) overrides it:
    :attr:`pending`, :meth:`pump` and :meth:`fileno` keep queued sends going while the inbox waits (transport.Link
    takes the outbox as ``pump``), :meth:`poll_drop` tells the inbox the right neighbour is gone."""

    @abc.abstractmethod
    def send(self, t: int, j: int) -> None:
        """Hand over chunk ``j`` of what step ``t`` sends; never waits for the neighbour."""

    @abc.abstractmethod
    def release(self, t: int, j: int) -> None:
        """Return once that chunk's bytes are no longer read from the tensor (bounded wait)."""

    @abc.abstractmethod
    def finish(self) -> None:
        """Return once no send of this collective reads the tensor any more (bounded wait)."""

    @property
    def pending(self) -> bool:
        """Whether sends are queued for later (see :class:`ShmOutbox`)."""
        return False

    def pump(self, wait_s: float) -> None:
        """Move queued sends on, waiting up to ``wait_s`` for room if none can go now."""

    def fileno(self) -> int | None:
        """A descriptor that turns readable when queued sends may go on (None: nothing is ever queued)."""
        return None

    def poll_drop(self) -> bool:
        """Whether the right neighbour's end has gone (no waiting)."""
        return False


class Inbox(Half):
    """The receiving half: the schedule calls :meth:`reduce` and :meth:`store` (see the module's docstring)."""

    @abc.abstractmethod
    def reduce(self, t: int, j: int, release: Callable[[int, int], None] | None = None) -> None:
        """Wait (bounded) for chunk ``j`` of step ``t`` and add it into the tensor, calling ``release(t, j)`` first
        when given."""

    @abc.abstractmethod
    def store(self, t: int, j: int) -> None:
        """Wait (bounded) for chunk ``j`` of step ``t`` and write it into the tensor."""


# ----- zmq: PUSH/PULL over tcp or ipc -------------------------------------------------------------------
class ZmqOutbox(Outbox):
    """Chunks up to 64 KiB travel in the header's frame, above 1 MiB zero-copy (tracked: see
    :meth:`release`), between them copied (:meth:`commlab.transport.sockets.Link.send`)."""

    def __init__(self, link: Link, me: int, peer: int, timeout: float):
        super().__init__(me, peer, link.who, timeout)
        self.link = link
        self.trackers: list = []

    def begin(self, c: Collective) -> None:
        self.c = c
        self.trackers = []  # per message sent, in order (step t, chunk j is t * K + j): a tracker, or None
        self.raw = c.work.view(torch.uint8).numpy().data

    def send(self, t: int, j: int) -> None:
        c = self.c
        lo, hi = c.sent(t, j)
        self.trackers.append(self.link.send(c.header(self.me, t, j, lo, hi), self.raw[lo * c.itemsize:hi * c.itemsize]))

    def _wait(self, tracker) -> None:
        if tracker is not None and not tracker.done:
            try:
                tracker.wait(self.timeout)
            except zmq.NotDone:
                raise CommTimeout(f"sends to {self.who} did not leave within {self.timeout:g}s",
                                  peer=self.peer, op="send") from None

    def release(self, t: int, j: int) -> None:
        self._wait(self.trackers[t * self.c.K + j])

    def finish(self) -> None:
        for tracker in self.trackers:  # zmq may still read our buffer until then
            self._wait(tracker)

    def poll_drop(self) -> bool:
        return self.link.poll_drop()

    def close(self, linger_s: float = 0.0) -> None:
        self.link.close(linger_s)


class ZmqInbox(Inbox):
    """Small chunks land in one reused scratch buffer (one frame, header first), large
    reduce-scatter chunks are added straight from zmq's frame, all-gather chunks are received
    straight into the caller's tensor."""

    def __init__(self, link: Link, me: int, peer: int, timeout: float, idle: Callable[[], None], outbox: Outbox):
        super().__init__(me, peer, link.who, timeout)
        self.link, self.idle, self.outbox = link, idle, outbox
        # small reduce-scatter chunks land here (and one-frame messages, header first)
        self.scratch = torch.empty(wire.COPY_THRESHOLD + wire.CHUNK_HEADER.size, dtype=torch.uint8)
        self.scratch_view = self.scratch.numpy().data
        self.scratch_np = self.scratch.numpy()

    def begin(self, c: Collective) -> None:
        self.c = c
        self.raw = c.work.view(torch.uint8).numpy().data

    def _receive(self, t: int, j: int, reduce: bool, release) -> None:
        c, link, isz, hsize = self.c, self.link, self.c.itemsize, wire.CHUNK_HEADER.size
        lo, hi = c.received(t, j)
        nbytes = (hi - lo) * isz
        expected = c.header(self.peer, t, j, lo, hi)
        # the right neighbour may close normally once it has had our last chunk; until then its drop is a loss
        watch = (self.outbox,) if t < c.steps - 1 or self.outbox.pending else ()
        if nbytes <= wire.INLINE_MAX:  # one frame, header then data, into the scratch buffer
            size = link.recv_message_into(self.scratch_view, self.timeout, watch, self.idle, self.outbox)
            if size != hsize + nbytes or bytes(self.scratch_view[:hsize]) != expected:
                wire.check_chunk_header(bytes(self.scratch_view[:min(size, hsize)]), expected, self.who,
                                        peer=self.peer)
                raise ProtocolError(f"{self.who} sent a {size}-byte message for elements [{lo}, {hi}) of "
                                    f"collective {c.seq} step {t}, expected {hsize + nbytes} in one frame",
                                    peer=self.peer, op="receive")
            if release is not None:
                release(t, j)
            if not reduce:
                self.raw[lo * isz:hi * isz] = self.scratch_view[hsize:hsize + nbytes]
            elif nbytes:
                c.add_array(lo, hi, self.scratch_np[hsize:hsize + nbytes])
            return
        got = link.recv_header(self.timeout, watch, self.idle, self.outbox)
        wire.check_chunk_header(got, expected, self.who, peer=self.peer)
        if not link.more():
            raise ProtocolError(f"{self.who} sent a chunk header without its data frame", peer=self.peer,
                                op="receive")
        if not reduce:  # all-gather: the final sum, straight into the caller's tensor
            size = link.recv_into(self.raw[lo * isz:hi * isz])
        elif nbytes <= len(self.scratch_view) - hsize:  # reduce-scatter, mid-sized: into the scratch, then add
            size = link.recv_into(self.scratch_view[:nbytes])
            if size == nbytes:
                if release is not None:
                    release(t, j)
                c.add_tensor(lo, hi, self.scratch[:nbytes].view(c.work.dtype))
        else:  # reduce-scatter, large: add straight from zmq's frame
            frame = link.recv_frame()
            size = len(frame)
            if size == nbytes:
                if release is not None:
                    release(t, j)
                c.add_tensor(lo, hi, torch.frombuffer(frame.buffer, dtype=c.work.dtype, count=hi - lo))
        if size != nbytes or link.more():
            raise ProtocolError(f"{self.who} sent {size} bytes for elements [{lo}, {hi}) of collective "
                                f"{c.seq} step {t}, expected {nbytes} in one frame", peer=self.peer, op="receive")

    def reduce(self, t: int, j: int, release=None) -> None:
        self._receive(t, j, True, release)

    def store(self, t: int, j: int) -> None:
        self._receive(t, j, False, None)

    def close(self, linger_s: float = 0.0) -> None:
        self.link.close(linger_s)


# ----- torch.distributed isend/irecv ---------------------------------------------------------------------
def _finish_work(w, timeout: float, peer: int, who: str, verb: str, op: str, seq: int) -> None:
    try:
        w.wait(timedelta(seconds=timeout))
    except Exception as exc:  # gloo raises RuntimeError for timeouts and closed connections alike
        cls, text = errors.from_torch(exc, otherwise=PeerLost)
        raise cls(f"{verb} {who} failed in collective {seq}: {text}", peer=peer, op=op) from exc


class TorchOutbox(Outbox):
    def __init__(self, group, me: int, peer: int, who: str, timeout: float):
        super().__init__(me, peer, who, timeout)
        self.group = group

    def begin(self, c: Collective) -> None:
        self.c = c
        self.sends: list = []  # per message sent, in order; None once waited for (gloo's second wait never returns)

    def send(self, t: int, j: int) -> None:
        import torch.distributed as dist
        lo, hi = self.c.sent(t, j)
        self.sends.append(dist.isend(self.c.work[lo:hi], dst=self.peer, group=self.group, tag=t * self.c.K + j))

    def _finish(self, m: int) -> None:
        if self.sends[m] is not None:
            _finish_work(self.sends[m], self.timeout, self.peer, self.who, "send to", "send", self.c.seq)
            self.sends[m] = None

    def release(self, t: int, j: int) -> None:
        self._finish(t * self.c.K + j)

    def finish(self) -> None:
        for m in range(len(self.sends)):
            self._finish(m)


class TorchInbox(Inbox):
    """Up to ``WINDOW`` receives are posted ahead: reduce-scatter ones into scratch slots, all-gather
    ones straight into the tensor. Tags number the messages of one collective so none can be matched
    to the wrong receive."""

    WINDOW = 4

    def __init__(self, group, me: int, peer: int, who: str, timeout: float):
        super().__init__(me, peer, who, timeout)
        self.group = group

    def begin(self, c: Collective) -> None:
        self.c = c
        self.total = c.steps * c.K
        self.window = min(self.total, self.WINDOW)
        per = max(hi - lo for lo, hi in (c.chunk(s, j) for s in range(len(c.bounds) - 1) for j in range(c.K)))
        adding = sum(reduce for _, _, reduce in c.plan) * c.K
        self.slots = [torch.empty(per, dtype=c.work.dtype, device=c.work.device)
                      for _ in range(min(self.window, adding))]
        self.recvs: dict = {}
        for m in range(self.window):
            self._post(m)

    def _post(self, m: int) -> None:
        import torch.distributed as dist
        c = self.c
        t, j = divmod(m, c.K)
        lo, hi = c.received(t, j)
        dest = self.slots[m % len(self.slots)][:hi - lo] if c.plan[t][2] else c.work[lo:hi]
        self.recvs[m] = (dist.irecv(dest, src=self.peer, group=self.group, tag=m), dest)

    def _take(self, m: int):
        w, dest = self.recvs.pop(m)
        _finish_work(w, self.timeout, self.peer, self.who, "receive from", "receive", self.c.seq)
        return dest

    def _next(self, m: int) -> None:
        if m + self.window < self.total:
            self._post(m + self.window)

    def reduce(self, t: int, j: int, release=None) -> None:
        m = t * self.c.K + j
        dest = self._take(m)
        if release is not None:
            release(t, j)
        lo, hi = self.c.received(t, j)
        self.c.add_tensor(lo, hi, dest)
        self._next(m)  # the slot is free again

    def store(self, t: int, j: int) -> None:
        m = t * self.c.K + j
        self._take(m)
        self._next(m)


# ----- shared memory, one host ---------------------------------------------------------------------------
SLOTS = 4  # per link: the sender runs up to this many chunks ahead of the receiver
TAKEN = struct.Struct("<Q")  # receiver -> sender: how many chunks of this link it has finished reading
SLICE_S = 0.05  # longest one poll waits before the deadline and the failure reports are looked at


def _seqpacket() -> socket.socket:
    return socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)


class ShmOutbox(Outbox):
    """Owns this rank's segment (``SLOTS`` slots of ``slot_bytes``) and the connection to the right
    neighbour. ``send`` copies a chunk into the next free slot and says READY; with no free slot the
    chunk waits in a queue (``pending``), which :meth:`pump` (called by every wait of this rank) and
    :meth:`release` / :meth:`finish` drain as TAKEN signals come back. A queued chunk is still read
    from the caller's tensor: the schedule writes nowhere it sent before ``release``/``finish``."""

    def __init__(self, segment, conn: socket.socket, slot_bytes: int, me: int, peer: int, who: str, timeout: float,
                 idle: Callable[[], None]):
        super().__init__(me, peer, who, timeout)
        self.segment, self.conn, self.slot_bytes, self.idle = segment, conn, slot_bytes, idle
        self.slots = segment.array()
        self.queue: collections.deque = collections.deque()
        self.sent = 0  # chunks put in slots on this link, ever (chunk k lives in slot k % SLOTS)
        self.taken = 0  # of those, how many the neighbour has finished reading
        self.placed = 0  # chunks of the current collective put in slots
        self.poller = select.poll()
        self.poller.register(conn.fileno(), select.POLLIN)
        self.hung_up = False

    @property
    def pending(self) -> bool:
        return bool(self.queue)

    def begin(self, c: Collective) -> None:
        self.c = c
        self.placed = 0
        self.raw = c.work.view(torch.uint8).numpy()

    def send(self, t: int, j: int) -> None:
        self.queue.append((t, j))
        self._place()

    def _drain_taken(self) -> None:
        """Read every TAKEN signal already here (no waiting)."""
        while True:
            try:
                msg = self.conn.recv(64, socket.MSG_DONTWAIT)
            except BlockingIOError:
                return
            except OSError as exc:
                raise PeerLost(f"{self.who} disconnected ({exc.strerror})", peer=self.peer, op="send") from None
            if not msg:
                self.hung_up = True
                raise PeerLost(f"{self.who} disconnected", peer=self.peer, op="send")
            if len(msg) != TAKEN.size or TAKEN.unpack(msg)[0] != self.taken + 1 or self.taken >= self.sent:
                raise ProtocolError(f"{self.who} sent a bad TAKEN signal {msg!r} (had {self.taken} of {self.sent})",
                                    peer=self.peer, op="send")
            self.taken += 1

    def _place(self) -> None:
        """Put queued chunks in free slots (no waiting)."""
        queue, c = self.queue, self.c
        while queue:
            if self.sent - self.taken >= SLOTS:
                self._drain_taken()
                if self.sent - self.taken >= SLOTS:
                    return
            t, j = queue[0]
            lo, hi = c.sent(t, j)
            nbytes = (hi - lo) * c.itemsize
            at = (self.sent % SLOTS) * self.slot_bytes
            np.copyto(self.slots[at:at + nbytes], self.raw[lo * c.itemsize:hi * c.itemsize])
            try:
                self.conn.send(c.header(self.me, t, j, lo, hi), socket.MSG_NOSIGNAL)
            except OSError as exc:
                raise PeerLost(f"send to {self.who} failed: {exc.strerror}", peer=self.peer, op="send") from None
            queue.popleft()
            self.sent += 1
            self.placed += 1

    def pump(self, wait_s: float) -> None:
        """Place what fits now, waiting up to ``wait_s`` for a TAKEN signal if nothing does."""
        self._place()
        if self.queue and wait_s > 0 and self.poller.poll(int(wait_s * 1000)):
            self._place()

    def _place_until(self, placed: int, what: str) -> None:
        deadline = time.monotonic() + self.timeout
        next_idle = time.monotonic() + 1.0
        self._place()
        while self.placed < placed:
            now = time.monotonic()
            if now >= deadline:
                raise CommTimeout(f"{self.who} took no chunk within {self.timeout:g}s ({what})", peer=self.peer,
                                  op="send")
            if now >= next_idle:
                self.idle()
                next_idle = now + 1.0
            self.pump(min(SLICE_S, deadline - now))

    def release(self, t: int, j: int) -> None:
        self._place_until(t * self.c.K + j + 1, f"chunk {j} of step {t}")

    def finish(self) -> None:
        self._place_until(self.placed + len(self.queue), "the collective's last chunks")

    def fileno(self) -> int | None:
        return self.conn.fileno()

    def poll_drop(self) -> bool:
        if not self.hung_up:
            p = select.poll()
            p.register(self.conn.fileno(), 0)  # POLLHUP and POLLERR are always reported
            self.hung_up = any(events & (select.POLLHUP | select.POLLERR) for _, events in p.poll(0))
        return self.hung_up

    def close(self, linger_s: float = 0.0) -> None:
        """With ``linger_s``: first wait (that long at most) until the right neighbour has taken every chunk
        placed, reading its TAKEN signals. Closing with signals unread would make the kernel report a
        reset to the neighbour ahead of READY signals it has not read yet (see :meth:`ShmInbox._recv_now`)."""
        if linger_s > 0 and not self.hung_up and self.slots is not None:
            deadline = time.monotonic() + linger_s
            try:
                while self.taken < self.sent:
                    left = deadline - time.monotonic()
                    if left <= 0:
                        break
                    if self.poller.poll(int(min(SLICE_S, left) * 1000)):
                        self._drain_taken()
            except (CommError, OSError):  # gone or confused: nothing left to wait for
                pass
        self.queue.clear()
        self.conn.close()
        self.slots = None
        self.segment.close()


class ShmInbox(Inbox):
    """Maps the left neighbour's segment and reads chunks straight out of its slots: adds them into
    the tensor (reduce-scatter) or copies them there (all-gather), then says TAKEN. Waits poll the
    connection from the left and, while this rank's outbox has queued sends, the one to the right."""

    def __init__(self, segment, conn: socket.socket, slot_bytes: int, me: int, peer: int, who: str, timeout: float,
                 idle: Callable[[], None], outbox: Outbox):
        super().__init__(me, peer, who, timeout)
        self.segment, self.conn, self.slot_bytes, self.idle, self.outbox = segment, conn, slot_bytes, idle, outbox
        self.slots = segment.array()
        self.got = 0  # chunks received on this link, ever (chunk k lives in slot k % SLOTS)
        self.left_gone = False

    def begin(self, c: Collective) -> None:
        self.c = c
        self.raw = c.work.view(torch.uint8).numpy()

    def _recv_now(self) -> bytes | None:
        """A signal from the left if one is here (b"": it hung up), None if none is (no waiting).

        A left neighbour that closed with our TAKEN signals unread makes the kernel report ECONNRESET
        once, ahead of the READY signals it sent before it closed (a Unix socket's pending error is
        returned before its queue): those are still ours, so read again."""
        for attempt in range(2):
            try:
                return self.conn.recv(64, socket.MSG_DONTWAIT)
            except BlockingIOError:
                return None
            except ConnectionResetError as exc:
                if attempt:
                    raise PeerLost(f"{self.who} disconnected ({exc.strerror})", peer=self.peer,
                                   op="receive") from None
            except OSError as exc:
                raise PeerLost(f"{self.who} disconnected ({exc.strerror})", peer=self.peer, op="receive") from None
        return None

    def _ready(self, t: int) -> bytes:
        """The next READY signal from the left (waiting, pumping the outbox, bounded)."""
        msg = self._recv_now()
        if msg is None:
            msg = self._wait(t)
        if not msg:
            raise PeerLost(f"{self.who} disconnected", peer=self.peer, op="receive")
        return msg

    def _wait(self, t: int) -> bytes:
        outbox = self.outbox
        out_fd = outbox.fileno()  # a shared-memory outbox: queued sends go on when it turns readable
        deadline = time.monotonic() + self.timeout
        next_idle = time.monotonic() + 1.0
        mine = self.conn.fileno()
        poller = select.poll()
        poller.register(mine, select.POLLIN)
        watching = None
        while True:
            # the right neighbour may close normally once it has had our last chunk; until then its drop is a loss
            watch = t < self.c.steps - 1 or outbox.pending
            if out_fd is not None:
                want = (select.POLLIN if outbox.pending else 0) if watch else None
                if want != watching:
                    if watching is not None:
                        poller.unregister(out_fd)
                    if want is not None:
                        poller.register(out_fd, want)
                    watching = want
            now = time.monotonic()
            wait_ms = max(0, int(min(SLICE_S, deadline - now) * 1000))
            for fd, events in poller.poll(wait_ms):
                if fd == mine:
                    msg = self._recv_now()
                    if msg is None:
                        continue
                    return msg
                if events & (select.POLLHUP | select.POLLERR):
                    raise PeerLost(f"{outbox.who} disconnected", peer=outbox.peer, op="receive")
            if out_fd is not None and outbox.pending:
                outbox.pump(0)
            if watch and out_fd is None and outbox.poll_drop():
                raise PeerLost(f"{outbox.who} disconnected", peer=outbox.peer, op="receive")
            now = time.monotonic()
            if now >= deadline:
                raise CommTimeout(f"no message from {self.who} within {self.timeout:g}s", peer=self.peer,
                                  op="receive")
            if now >= next_idle:
                self.idle()
                next_idle = now + 1.0

    def _take(self, t: int, j: int) -> tuple[int, int, int]:
        """Wait for chunk j of step t; (lo, hi, where its bytes start in the left's segment)."""
        c = self.c
        lo, hi = c.received(t, j)
        got = self._ready(t)
        expected = c.header(self.peer, t, j, lo, hi)
        if got != expected:
            wire.check_chunk_header(got, expected, self.who, peer=self.peer)
        if (hi - lo) * c.itemsize > self.slot_bytes:
            raise ProtocolError(f"chunk [{lo}, {hi}) of step {t} does not fit {self.who}'s {self.slot_bytes}-byte "
                                f"slots: do the ranks use the same chunk_mb?", peer=self.peer, op="receive")
        at = (self.got % SLOTS) * self.slot_bytes
        self.got += 1
        return lo, hi, at

    def _taken(self) -> None:
        try:
            self.conn.send(TAKEN.pack(self.got), socket.MSG_NOSIGNAL)
        except OSError:  # the left neighbour has finished and gone: a real loss shows at the next receive
            pass

    def reduce(self, t: int, j: int, release=None) -> None:
        lo, hi, at = self._take(t, j)
        if release is not None:
            release(t, j)
        self.c.add_array(lo, hi, self.slots[at:at + (hi - lo) * self.c.itemsize])
        self._taken()

    def store(self, t: int, j: int) -> None:
        lo, hi, at = self._take(t, j)
        isz = self.c.itemsize
        np.copyto(self.raw[lo * isz:hi * isz], self.slots[at:at + (hi - lo) * isz])
        self._taken()

    def close(self, linger_s: float = 0.0) -> None:
        self.conn.close()
        self.slots = None
        self.segment.close()
