"""``ps://...?transport=shm|auto``: tensor payloads between a worker and a server of one host in shared memory.

The zmq connection stays: it carries every header, acknowledgement and error, so timeouts, probes,
reconnects and "who is dead" work as over tcp. Only the bytes of pushes and of parameter/average
pulls move through two segments per connection, both created by the server (so they live under
its name, ``/dev/shm/commlab-<run>-<server pid>.<start>-s<shard>-<n>-in|out``, see
:mod:`commlab.transport.shm`)::

    worker                                            shard
      hello {shm_host: host identity}           ->    same boot id and network namespace? make a link:
                                                <-    ok {shm_link: {in, out, size}}   (or {refused: why})
      maps both, unlinks both files
      push [header only] {shm: [byte offsets]}  ->    reduces straight out of "in" at those offsets
      pull {shm_reply: true}                    ->    copies the values into "out"
                                                <-    params [header only] {shm: [byte offsets]}
      copies them out of "out" into the parameters

Each piece of the shard has a fixed place in both segments (:func:`layout`, hello order, 64-byte
aligned), so every byte is copied once in and once out. A place is written again only after the
request that used it was answered (the worker's steps are serial, and a reconnect gets a fresh
link), so no slot bookkeeping is needed. Each side checks every offset it is given against the
segment's size and the dtype's alignment (:func:`commlab.transport.wire.decode`) before touching a byte: a
header cannot make a server read or write outside a segment. The segments are mode 0600: only
the server's own user can map them (who could equally kill the server).

Lifetime: the worker unlinks both files as soon as it has mapped them (the server unlinks them
too on first use, and when the link is replaced or ends); until then they are the server's
tracked entries, removed at exit, SIGTERM and Ctrl-C, and by :func:`commlab.transport.shm.sweep_stale`
after a kill -9.
"""

from __future__ import annotations

import torch

from commlab.transport import shm, wire

ALIGN = 64


def layout(pieces: list[tuple[str, str, int]]) -> tuple[dict[str, int], int]:
    """Byte offset of each piece ``(key, dtype, numel)`` in a link's segments, and their size."""
    at, size = {}, 0
    for key, dtype, numel in pieces:
        at[key] = size
        size += -(-wire.DTYPES[dtype].itemsize * numel // ALIGN) * ALIGN
    return at, size


class Region:
    """One direction of a link: a mapped segment's data bytes as a memoryview and a uint8 tensor."""

    def __init__(self, segment: shm.Segment):
        self.segment = segment
        self.size = segment.size
        self.view = memoryview(segment.mm)[shm.HEADER_BYTES:shm.HEADER_BYTES + segment.size]
        self.bytes = torch.frombuffer(self.view, dtype=torch.uint8) if self.size else torch.empty(0, dtype=torch.uint8)

    def write(self, at: int, t: torch.Tensor) -> None:
        """Copy the flat tensor ``t`` to byte ``at`` (the caller's layout keeps it inside and aligned)."""
        n = t.numel() * t.element_size()
        if at < 0 or at + n > self.size or at % t.element_size():
            raise ValueError(f"{n} bytes at {at} do not fit a shared region of {self.size} bytes")
        if n:
            self.bytes[at:at + n].view(t.dtype).copy_(t.reshape(-1))

    def frames(self, h: wire.Header) -> list[memoryview]:
        return wire.region_frames(h, self.view)

    def close(self) -> None:
        self.bytes = torch.empty(0, dtype=torch.uint8)
        try:
            self.view.release()
        except BufferError:  # a tensor still views it: the mapping goes with the last view
            pass
        self.segment.close()


def place(offsets: dict[str, int], parts: list) -> list[int]:
    """Byte offsets of wire parts ``(FrameSpec, tensor)`` under a layout (a piece's frames follow each other)."""
    return [offsets[spec.key] + spec.offset * wire.DTYPES[spec.dtype].itemsize for spec, _ in parts]


class Payloads:
    """How one end of a ps:// connection moves the tensor payloads of its messages, so that the client and
    the server send and receive without asking how: this base sends them as zmq data frames after the
    header (a connection without a link, :data:`FRAMES`); a :class:`Link` through shared memory. Headers
    always travel over zmq. Not thread-safe: one connection's end, used by the thread that owns it."""

    kind = "zmq frames"
    rx_size: int | None = None  # bytes a received header's offsets may point into (wire.decode's region=): none

    def place(self, parts: list) -> list[int] | None:
        """Ready the wire parts ``(FrameSpec, tensor)`` of a message to send: None when they travel as frames
        after the header (wire.encode's default), else their byte offsets in the shared region they have just
        been copied into (the header carries those instead). Blocks only for the copy."""
        return None

    def reply_meta(self) -> dict:
        """What a pull of parameters or sums adds to its header to have the reply's payload come this way."""
        return {}

    def take(self, h: wire.Header, frames: list) -> list:
        """The data of a received message whose header is ``h``: ``frames`` (those after the header), or views
        of the shared region at the offsets ``h`` names (valid until this end places parts there again)."""
        return frames

    def close(self) -> None:
        pass


FRAMES = Payloads()  # stateless: shared by every connection without a link


class Link(Payloads):
    """A connection's two regions: ``inbound`` (the worker writes, the server reads) and ``outbound``. As
    :class:`Payloads` it is one end's view: the server's (:meth:`create`) places into ``outbound`` and
    takes from ``inbound``, the worker's (:meth:`attach`) the other way round."""

    kind = "shm"

    def __init__(self, inbound: Region, outbound: Region, offsets: dict[str, int], worker: bool):
        self.inbound, self.outbound, self.offsets = inbound, outbound, offsets
        self.tx, self.rx = (inbound, outbound) if worker else (outbound, inbound)
        self.rx_size = self.rx.size
        self.worker = worker
        self.unlinked = False

    def place(self, parts: list) -> list[int] | None:
        if not parts:
            return None
        at = place(self.offsets, parts)
        for (_, t), o in zip(parts, at):
            self.tx.write(o, t)
        return at

    def reply_meta(self) -> dict:
        return {"shm_reply": True} if self.worker else {}

    def take(self, h: wire.Header, frames: list) -> list:
        if "shm" not in h.meta:
            return frames
        self.unlink()  # the peer has mapped it (the worker unlinks at once): nothing stays in /dev/shm
        return self.rx.frames(h)

    @classmethod
    def create(cls, run: str, what: str, pieces: list[tuple[str, str, int]]) -> "Link":
        """The server's side: two fresh segments sized for ``pieces``."""
        offsets, size = layout(pieces)
        inbound = shm.Segment.create(run, f"{what}-in", size)
        try:
            outbound = shm.Segment.create(run, f"{what}-out", size)
        except BaseException:
            inbound.close()
            raise
        return cls(Region(inbound), Region(outbound), offsets, worker=False)

    def describe(self) -> dict:
        return {"in": self.inbound.segment.path, "out": self.outbound.segment.path, "size": self.inbound.size}

    @classmethod
    def attach(cls, offer: dict, pieces: list[tuple[str, str, int]]) -> "Link":
        """The worker's side: map the server's two segments (checked: names, magic, sizes) and unlink them."""
        offsets, size = layout(pieces)
        if offer.get("size") != size:
            raise ValueError(f"the server's segments hold {offer.get('size')} bytes, this worker's pieces need {size}")
        inbound = shm.Segment.attach(str(offer["in"]), size)
        try:
            outbound = shm.Segment.attach(str(offer["out"]), size)
        except BaseException:
            inbound.close()
            raise
        link = cls(Region(inbound), Region(outbound), offsets, worker=True)
        link.unlink()  # mapped: nothing left in /dev/shm for a kill -9 to strand
        return link

    def unlink(self) -> None:
        if not self.unlinked:
            self.inbound.segment.unlink()
            self.outbound.segment.unlink()
            self.unlinked = True

    def close(self) -> None:
        self.unlink()
        self.inbound.close()
        self.outbound.close()
