"""The only place sockets are made: pyzmq with limits, deadlines, loopback-by-default and CURVE.

Regimes ask for a socket of a kind bound or connected to an endpoint, and for
"send these frames" / "receive one message within T seconds from WHO". Below
this line: linger 0 (a dead peer never blocks close), inbound frame size
limits enforced by libzmq itself (``MAXMSGSIZE``, per frame), zero-copy sends
for big frames and copies for small ones, and errors translated into the
:mod:`commlab.base.errors` hierarchy naming the peer.

Security: binding to anything but loopback (127.0.0.0/8, ::1, localhost) or an
``ipc://`` path requires CURVE keys, or ``insecure=True`` said in so many words. On every endpoint a
job's processes also prove the job's secret to each other (:mod:`commlab.transport.auth`): :func:`handshake`
on a DEALER (the ``ps://`` client; the server answers in its loop), :meth:`Transport.admit_plain`
for a PULL whose senders prove it in zmq's own PLAIN handshake (the ring's links).
"""

from __future__ import annotations

import ipaddress
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Sequence
from urllib.parse import urlsplit

import zmq

from commlab.transport import auth, wire
from commlab.base.errors import CommError, CommTimeout, ConfigError, PeerLost

# libzmq drops (disconnects) a peer that sends a frame larger than this.
DEFAULT_MAX_FRAME = wire.MAX_FRAME + 2**16
# Kernel send buffer of connections within one host (loopback TCP, ipc; SO_SNDBUF). Loopback TCP
# otherwise grows it to 4 MiB: MBs then wait in the receiver's queue and are copied out of memory
# rather than cache. Measured on this 2-core machine: ring all-reduce 256 MiB 136 -> 91 ms,
# parameter-server rounds +29% over tcp. Connections to other hosts keep the kernel's autotuning:
# a fixed buffer would cap a link with a large bandwidth-delay product (1 MiB per 10 ms RTT is 100 MB/s).
DEFAULT_SNDBUF = 512 * 2**10


@dataclass(frozen=True)
class CurveKeys:
    """A CURVE identity: our key pair, and for a client the server's public key (z85 bytes)."""

    public: bytes
    secret: bytes
    server_public: bytes | None = None

    @classmethod
    def load(cls, secret_file: str | os.PathLike, server_public_file: str | os.PathLike | None = None) -> "CurveKeys":
        import zmq.auth
        public, secret = zmq.auth.load_certificate(str(secret_file))
        if secret is None:
            raise ConfigError(f"{secret_file} holds no secret key (pass the .key_secret file)")
        server = zmq.auth.load_certificate(str(server_public_file))[0] if server_public_file else None
        return cls(public, secret, server)


def is_loopback(endpoint: str) -> bool:
    """True for ipc://, inproc:// and tcp:// on 127.0.0.0/8, ::1 or localhost."""
    scheme = endpoint.split("://", 1)[0]
    if scheme in ("ipc", "inproc"):
        return True
    host = host_of(endpoint)
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def host_of(endpoint: str) -> str:
    return urlsplit(endpoint).hostname or ""


def tcp_endpoint(address: str) -> str:
    """``host:port`` or a full endpoint -> a zmq endpoint."""
    return address if "://" in address else f"tcp://{address}"


def ping_interval(heartbeat_s: float) -> float:
    """Seconds between a heartbeat connection's pings: a tenth of ``heartbeat_s``, at most 0.1 s. The peer learns
    the TTL from the first ping only (until then it cannot time the connection out), so the first must go soon:
    a client that waits 1.5 intervals after connecting (``ps://``'s heartbeat does) has sent it."""
    return min(heartbeat_s / 10, 0.1)


class Transport:
    """A zmq context plus the rules every socket follows. One per process side (client or server).

    Thread-safety: the context is thread-safe; each socket belongs to one thread.
    """

    def __init__(self, io_threads: int = 1, max_frame: int = DEFAULT_MAX_FRAME, curve: CurveKeys | None = None,
                 sndbuf: int | None = DEFAULT_SNDBUF):
        self.ctx = zmq.Context(io_threads=io_threads)
        self.io_threads = io_threads
        self.sndbuf = sndbuf  # bytes for loopback and ipc endpoints, or None: the system's autotuning
        self.max_frame = max_frame
        self.curve = curve
        self._auth: Any = None  # zmq.auth.thread.ThreadAuthenticator once a CURVE server binds

    def socket(self, kind: int) -> zmq.Socket:
        sock = self.ctx.socket(kind)
        sock.linger = 0
        sock.setsockopt(zmq.MAXMSGSIZE, self.max_frame)
        return sock

    def bind(self, kind: int, endpoint: str, *, insecure: bool = False, authorized: str | os.PathLike | None = None,
             io_thread: int | None = None, curve: CurveKeys | None = None, plain: bool = False) -> zmq.Socket:
        """A server socket. Non-loopback needs CURVE keys (``authorized``: a folder of client
        ``*.key`` files; every client key there may connect) or ``insecure=True``. ``io_thread``:
        which of the context's I/O threads moves this socket's bytes (see :meth:`pin`). ``curve``:
        this socket's server key pair, where it is not the transport's own (a process that is a
        CURVE server and a client at once, as a ring's rank is). ``plain`` (without CURVE): a zmq PLAIN
        server, admitting only what :meth:`admit_plain` says (nobody until it is called)."""
        curve = curve or self.curve
        if not is_loopback(endpoint) and curve is None and not insecure:
            raise ConfigError(f"refusing to bind {endpoint} without authentication: it is reachable from other "
                              f"machines. Create keys with 'commlab keys' and start with --keys DIR, or pass "
                              f"--insecure to accept anyone")
        sock = self.pin(self.socket(kind), io_thread)
        if curve is not None:
            self._start_auth(authorized)
            self._curve_keys(sock, curve)
            sock.curve_server = True
        elif plain:
            self._authenticator()  # before the first connection: without a ZAP handler PLAIN admits anyone
            sock.plain_server = True
        return _open(sock, sock.bind, "bind", endpoint, self.sndbuf)

    def connect(self, kind: int, endpoint: str, identity: bytes | None = None,
                io_thread: int | None = None, curve: CurveKeys | None = None,
                plain: tuple[str, str] | None = None, heartbeat_s: float = 0.0,
                before: Callable[[zmq.Socket], None] | None = None) -> zmq.Socket:
        """A client socket. ``io_thread``: see :meth:`pin`; ``curve``: as in :meth:`bind`; ``plain``
        (without CURVE): the (user name, password) a PLAIN server's :meth:`admit_plain` expects.
        ``heartbeat_s`` > 0: zmq pings the peer every :func:`ping_interval` and asks it (ZMTP's TTL, which
        travels in the pings) to close the connection when nothing came from this side for that long: a frozen
        or partitioned process (whose I/O threads stop too) loses its connection within ``heartbeat_s`` once
        its first ping went. ``before`` is called with the socket before it connects (a monitor attached there
        sees the connection made)."""
        sock = self.pin(self.socket(kind), io_thread)
        if heartbeat_s > 0:
            sock.setsockopt(zmq.HEARTBEAT_IVL, max(1, int(ping_interval(heartbeat_s) * 1000)))
            sock.setsockopt(zmq.HEARTBEAT_TTL, max(100, int(heartbeat_s * 1000)))  # (whole deciseconds)
            sock.setsockopt(zmq.HEARTBEAT_TIMEOUT, max(1, int(heartbeat_s * 1000)))
        if identity is not None:
            sock.identity = identity
        curve = curve or self.curve
        if curve is not None:
            if curve.server_public is None:
                raise ConfigError(f"CURVE client for {endpoint} needs the server's public key")
            self._curve_keys(sock, curve)
            sock.curve_serverkey = curve.server_public
        elif plain is not None:
            sock.plain_username, sock.plain_password = (x.encode() for x in plain)
        if before is not None:
            before(sock)
        return _open(sock, sock.connect, "connect to", endpoint, self.sndbuf)

    def pin(self, sock: zmq.Socket, io_thread: int | None) -> zmq.Socket:
        """Serve ``sock``'s connections from I/O thread ``io_thread`` (0-based; None: libzmq picks the
        least loaded one, which depends on the order sockets were made). Set before bind/connect.

        Two sockets that stream at once in opposite directions (a ring's PULL from the left and PUSH
        to the right) run much faster on two I/O threads than on one: each thread then only
        copies one way, instead of one thread taking turns between writing and reading."""
        if io_thread is not None:
            if not 0 <= io_thread < self.io_threads:
                raise ConfigError(f"I/O thread {io_thread} does not exist: the context has {self.io_threads}")
            sock.affinity = 1 << io_thread
        return sock

    @staticmethod
    def _curve_keys(sock: zmq.Socket, keys: "CurveKeys") -> None:
        sock.curve_secretkey = keys.secret
        sock.curve_publickey = keys.public

    def _start_auth(self, authorized) -> None:
        if authorized is None or not Path(authorized).is_dir():
            raise ConfigError("a CURVE server needs a folder of authorised client public keys")
        self._authenticator().configure_curve(domain="*", location=str(authorized))

    def _authenticator(self):
        """The context's ZAP handler (a thread pyzmq runs), started on first use."""
        if self._auth is None:
            from zmq.auth.thread import ThreadAuthenticator
            self._auth = ThreadAuthenticator(self.ctx)
            self._auth.start()
        return self._auth

    def admit_plain(self, passwords: dict[str, str]) -> None:
        """zmq PLAIN servers of this context (sockets with ``plain_server`` set before they bind) admit exactly
        these user names with these passwords from now on; every other connection fails its handshake
        (libzmq reports HANDSHAKE_FAILED_AUTH to the socket's monitor: :class:`Link` counts it) and never
        delivers a message. ``{}`` shuts the door. Thread-safe (the ZAP thread reads it per handshake)."""
        self._authenticator().configure_plain(domain="*", passwords=dict(passwords))

    def close(self) -> None:
        if self._auth is not None:
            self._auth.stop()
            self._auth = None
        self.ctx.destroy(linger=0)


def close_monitored(sock: zmq.Socket | None, monitor: zmq.Socket | None, linger_ms: int = 0) -> None:
    """Close a socket that ``get_monitor_socket`` watches, and its monitor. The monitor is disabled first:
    closing the socket alone leaves libzmq's side of the monitor open, a file descriptor and its inproc
    address (``inproc://monitor.s-FD``) held, so a later socket given the same descriptor fails to monitor
    with "Address already in use" (a worker failing over between a shard's servers did, in a chaos run)."""
    stop_monitor(sock, monitor)
    if sock is not None:
        sock.close(linger=linger_ms)


def stop_monitor(sock: zmq.Socket | None, monitor: zmq.Socket | None) -> None:
    """Disable ``sock``'s monitor and close the monitor's socket; ``sock`` stays open (see :func:`close_monitored`)."""
    if sock is not None and monitor is not None:
        try:
            sock.disable_monitor()
        except zmq.ZMQError:
            pass
    if monitor is not None:
        monitor.close(linger=0)


def _open(sock: zmq.Socket, attach, verb: str, endpoint: str, sndbuf: int | None) -> zmq.Socket:
    """``attach(endpoint)`` (the socket's bind or connect), with ``sndbuf`` for connections within
    this host; on failure close the socket and say why."""
    if sndbuf is not None and is_loopback(endpoint):
        sock.sndbuf = sndbuf
    try:
        attach(endpoint)
    except zmq.ZMQError as exc:
        sock.close()
        raise CommError(f"cannot {verb} {endpoint}: {exc}") from exc
    return sock


def handshake(sock: zmq.Socket, secret: "auth.JobSecret", who: str, name: str, timeout: float,
              peer: int | str | None = None) -> str:
    """Prove the job's secret to the server behind a fresh DEALER ``sock`` and have it prove it back
    (:func:`commlab.transport.auth.initiate`), each message within ``timeout``. Returns the server's name; AuthError
    (a :class:`~commlab.base.errors.ProtocolError`) when it is not this job's, CommTimeout when it is silent.
    Blocks; the socket's first messages."""
    def recv_one() -> bytes:
        frames = recv(sock, timeout, name, peer)
        return frames[0].bytes if len(frames) == 1 else b""

    try:
        return auth.initiate(secret, who, name, lambda b: send(sock, [b], timeout=timeout, who=name, peer=peer),
                             recv_one)
    except auth.AuthError as exc:
        raise auth.AuthError(f"{exc} (is {name} this job's, started with the job's secret: --secret-file FILE or "
                             f"${auth.SECRET_FILE_ENV}?)", peer=peer, op="connect") from None


def send(sock: zmq.Socket, frames: Sequence, *, timeout: float | None = None, who: str = "peer",
         peer: int | str | None = None) -> int:
    """Send one multipart message; small frames copied, large ones zero-copy. Returns data bytes.
    ``peer``: the rank or shard the errors carry (:class:`~commlab.base.errors.CommError` fields)."""
    return _send(sock, frames, timeout, who, track=False, peer=peer)[0]


def send_tracked(sock: zmq.Socket, frames: Sequence, *, timeout: float | None = None,
                 who: str = "peer") -> tuple[int, list]:
    """:func:`send`, also returning, per frame in order, a ``zmq.MessageTracker`` for a frame
    sent zero-copy or None for one that was copied.

    libzmq reads a zero-copy frame's buffer after this returns: the caller must not write
    that buffer until its tracker is ``done``."""
    return _send(sock, frames, timeout, who, track=True)


def _send(sock, frames, timeout, who, track, peer=None):
    last = len(frames) - 1
    total = 0
    trackers: list = []
    try:
        for i, f in enumerate(frames):
            n = memoryview(f).nbytes
            total += n
            flags = zmq.SNDMORE if i < last else 0
            if timeout is not None and not sock.poll(int(timeout * 1000), zmq.POLLOUT):
                raise CommTimeout(f"sending to {who} blocked for {timeout:g}s (its queue is full: is it alive?)",
                                  peer=peer, op="send")
            copy = n <= wire.COPY_THRESHOLD
            tracker = sock.send(f, flags, copy=copy, track=track and not copy)
            trackers.append(tracker if track and not copy else None)
    except zmq.ZMQError as exc:
        raise PeerLost(f"send to {who} failed: {exc}", peer=peer, op="send") from exc
    return total, trackers


def recv(sock: zmq.Socket, timeout: float, who: str, peer: int | str | None = None) -> list[zmq.Frame]:
    """Receive one multipart message within ``timeout`` seconds or raise naming ``who`` (and carrying
    ``peer``)."""
    try:
        if not sock.poll(int(timeout * 1000), zmq.POLLIN):
            raise CommTimeout(f"no message from {who} within {timeout:g}s", peer=peer, op="receive")
        return sock.recv_multipart(copy=False)
    except zmq.ZMQError as exc:
        raise PeerLost(f"receive from {who} failed: {exc}", peer=peer, op="receive") from exc


def recv_bounded(sock: zmq.Socket, max_parts: int) -> tuple[list[zmq.Frame], int]:
    """Receive the waiting multipart message (call after a poll said one is there), keeping at
    most ``max_parts`` frames zero-copy. Returns ``(frames, count)``: ``count > len(frames)``
    means the message was longer and the rest was read and dropped frame by frame, so a peer
    cannot make us hold more than ``max_parts`` frames (each at most ``MAXMSGSIZE``)."""
    frames = [sock.recv(copy=False)]
    count = 1
    while sock.rcvmore:
        frame = sock.recv(copy=False)
        count += 1
        if count <= max_parts:
            frames.append(frame)
    return frames, count


_HANDSHAKE_FAILED = (zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
                     | zmq.EVENT_HANDSHAKE_FAILED_AUTH)


class Link:
    """One direction of a point-to-point stream with one named peer: a PUSH that sends to it or a
    PULL that receives from it, plus a monitor that notices at once when the peer's connection drops.

    zmq reconnects silently and never tells a blocked caller that its peer died; the monitor's
    ``DISCONNECTED`` event is what turns a SIGKILLed neighbour into :class:`PeerLost` within one
    receive slice (``SLICE_S``) instead of a timeout. Messages already received stay readable after a drop, so a
    peer that finished and closed normally is not mistaken for a lost one (see :meth:`_first_frame`).

    Thread-safety: one thread at a time (hand it over under a lock, which is a memory barrier).
    High-water marks are off: the caller bounds what is in flight (a ring has at most one
    collective's chunks queued). ``peer`` (a rank, or None) is set on every error raised here.
    """

    SLICE_S = 0.05  # longest a receive waits inside libzmq before the monitors are looked at

    def __init__(self, sock: zmq.Socket, who: str, peer: int | str | None = None):
        self.sock, self.who, self.peer = sock, who, peer
        sock.sndhwm = 0
        sock.rcvhwm = 0
        sock.rcvtimeo = int(self.SLICE_S * 1000)
        self.monitor = sock.get_monitor_socket(zmq.EVENT_DISCONNECTED | _HANDSHAKE_FAILED)
        self.dropped = False
        self.failed = 0  # connections whose handshake failed and whose DISCONNECTED is still to come
        self.refused = 0  # connections whose handshake failed, ever (strangers: without keys or the job's secret)

    def refusals(self) -> int:
        """Connections refused so far (their handshakes failed), with the monitor's latest events read."""
        self.poll_drop()
        return self.refused

    def poll_drop(self) -> bool:
        """Drain monitor events; True once the peer's connection has dropped. A connection whose
        handshake failed (a stranger without the CURVE keys, or one that left before the greeting) is
        not the peer: libzmq reports its HANDSHAKE_FAILED_* before its DISCONNECTED, and that
        DISCONNECTED is not counted, so a stranger knocking on a bound socket cannot end the run."""
        from zmq.utils.monitor import recv_monitor_message
        while self.monitor.poll(0):
            event = recv_monitor_message(self.monitor)["event"]
            if event & _HANDSHAKE_FAILED:
                self.failed += 1
                self.refused += 1
            elif event == zmq.EVENT_DISCONNECTED:
                if self.failed:
                    self.failed -= 1
                else:
                    self.dropped = True
        return self.dropped

    # ----- sending ----------------------------------------------------------------------------
    def send(self, header: bytes, data: memoryview) -> "zmq.MessageTracker | None":
        """Queue ``[header, data]`` without blocking. Data up to :data:`wire.INLINE_MAX` travels in
        the header's frame (one frame: half the per-message calls); above :data:`wire.COPY_THRESHOLD`
        it goes zero-copy and a tracker is returned: the caller must not write ``data`` until it is done."""
        big = data.nbytes > wire.COPY_THRESHOLD
        try:
            if data.nbytes <= wire.INLINE_MAX:
                self.sock.send(b"".join((header, data)), zmq.NOBLOCK)
                return None
            self.sock.send(header, zmq.SNDMORE | zmq.NOBLOCK)
            if big:
                return self.sock.send(data, zmq.NOBLOCK, copy=False, track=True)
            self.sock.send(data, zmq.NOBLOCK)
            return None
        except zmq.ZMQError as exc:
            raise PeerLost(f"send to {self.who} failed: {exc}", peer=self.peer, op="send") from exc

    # ----- receiving --------------------------------------------------------------------------
    def _first_frame(self, receive, timeout: float, watch: Sequence, idle, pump=None,
                     idle_every: float = 1.0):
        """``receive()`` the first frame of the next message, blocking at most ``timeout`` seconds.

        The socket's receive timeout is one slice (``SLICE_S``): the receive itself waits inside
        libzmq (no poll, no exception on the fast path), and between slices the monitors are read.
        Raises :class:`PeerLost` when this link's peer (once nothing more is queued from it) or a
        link in ``watch`` dropped, :class:`CommTimeout` naming the peer after ``timeout``.
        ``idle()`` runs every ``idle_every`` seconds of waiting and may raise to end the wait
        (the ring reads failure reports other ranks left in the rendezvous store with it).
        ``pump``: an object with ``pending`` and ``pump(wait_s)``, whose work goes on while this
        waits (a ring's shared-memory outbox with sends waiting for a free slot): while it has
        some, the wait takes turns between it (up to 2 ms) and a non-blocking receive.
        Items of ``watch`` need ``poll_drop()``, ``who`` and ``peer``.
        """
        deadline = time.monotonic() + timeout
        next_idle = time.monotonic() + idle_every
        while True:
            try:
                if pump is not None and pump.pending:
                    pump.pump(0.002)
                    return receive(zmq.NOBLOCK)
                return receive(0)
            except zmq.Again:
                pass
            except zmq.ZMQError as exc:
                raise PeerLost(f"receive from {self.who} failed: {exc}", peer=self.peer, op="receive") from exc
            if self.poll_drop():
                # The drop event can overtake the last messages on their way into the socket's queue.
                if self.sock.poll(100, zmq.POLLIN):
                    continue
                raise PeerLost(f"{self.who} disconnected", peer=self.peer, op="receive")
            for link in watch:
                if link.poll_drop():
                    raise PeerLost(f"{link.who} disconnected", peer=link.peer, op="receive")
            now = time.monotonic()
            if now >= deadline:
                raise CommTimeout(f"no message from {self.who} within {timeout:g}s", peer=self.peer, op="receive")
            if idle is not None and now >= next_idle:
                idle()
                next_idle = time.monotonic() + idle_every

    def recv_message_into(self, buf: memoryview, timeout: float, watch: Sequence = (), idle=None,
                          pump=None) -> int:
        """The next message's first frame written into ``buf`` (waiting as :meth:`_first_frame` says);
        returns the frame's full size (larger than ``buf`` means truncated: the caller compares)."""
        return self._first_frame(lambda flags: self.sock.recv_into(buf, flags=flags), timeout, watch, idle, pump)

    def recv_header(self, timeout: float, watch: Sequence = (), idle=None, pump=None) -> bytes:
        """The first frame of the next message (small: copied), waiting as :meth:`_first_frame` says."""
        return self._first_frame(self.sock.recv, timeout, watch, idle, pump)

    def recv_into(self, buf: memoryview) -> int:
        """The next frame of the current message, written into ``buf``; returns the frame's full
        size (larger than ``buf`` means it was truncated: the caller compares with what it expects)."""
        try:
            return self.sock.recv_into(buf, flags=zmq.NOBLOCK)
        except zmq.ZMQError as exc:
            raise PeerLost(f"receive from {self.who} failed mid-message: {exc}", peer=self.peer, op="receive") from exc

    def recv_frame(self) -> zmq.Frame:
        """The next frame of the current message, zero-copy (read it with ``torch.frombuffer``)."""
        try:
            return self.sock.recv(zmq.NOBLOCK, copy=False)
        except zmq.ZMQError as exc:
            raise PeerLost(f"receive from {self.who} failed mid-message: {exc}", peer=self.peer, op="receive") from exc

    def more(self) -> bool:
        """Whether the current message has another frame."""
        return bool(self.sock.getsockopt(zmq.RCVMORE))

    def close(self, linger_s: float = 0.0) -> None:
        """Close; ``linger_s`` > 0 lets queued messages leave first (bounded)."""
        close_monitored(self.sock, self.monitor, int(linger_s * 1000))
