"""A job's processes prove to each other that they hold the job's secret: written once, used by every
connection commlab opens (the ring's links, the parameter-server client and server).

Where the secret comes from: ``COMMLAB_JOB_SECRET_FILE`` (a file only its owner may read: mode 0600 or
stricter, owned by this user) or ``COMMLAB_JOB_SECRET`` (the secret itself, at least 16 bytes). Never
from the rendezvous store: torch's TCPStore is unauthenticated, any local user can read and write it.
``commlab run`` and ``commlab train`` create one per job (:func:`create_file`) unless their environment
already names one (servers started by hand with ``commlab server --secret-file F`` then share it).
Without a secret (a script under torchrun whose user set none) commlab runs unauthenticated as it did
before, says so on stderr once per process, and records ``authentication: none`` in the exchanger's
facts and the servers' stats: refusing to run would break every torchrun user, and a secret cannot be
derived from nothing the ranks share that a stranger could not read too.

The handshake (:class:`Initiator`, :class:`Responder`), over any channel that carries messages both
ways (a DEALER/ROUTER pair, a Unix socket)::

    initiator I                                        responder R
    {auth: 1, nonce: nI, who: I}             ──►
                                             ◄──        {auth: 1, nonce: nR, who: R,
                                                         proof: H("responder", nI, nR, R, I)}
    checks R's proof over its own nI
    {auth: 1, proof: H("initiator", nR, nI, I, R)} ──►
                                             ◄──        {auth: 1, ok: true}   (checks I's proof over nR)

``H`` is HMAC-SHA256 keyed by the secret over length-prefixed fields; nonces are 32 fresh random bytes,
so each side proves the secret over the other's challenge and a recorded exchange replays to nothing.
One round trip and a half per connection, nothing per message. Store values are signed likewise
(:func:`put`, :func:`get`): HMAC over the key and the value, so a value a stranger wrote, or one copied
from another key, is refused by name.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import stat
import sys
from dataclasses import dataclass, field

import msgpack

from commlab.base.errors import AuthError, ConfigError

SECRET_ENV = "COMMLAB_JOB_SECRET"
SECRET_FILE_ENV = "COMMLAB_JOB_SECRET_FILE"
MIN_SECRET = 16  # bytes
NONCE = 32
MAX_MESSAGE = 1024  # a handshake message is ~150 bytes; anything longer is refused unread
SIGNED = b"CLS1"  # a signed store value: SIGNED + 32-byte tag + value


@dataclass(frozen=True)
class JobSecret:
    """The job's shared secret and where it came from (for messages; the secret is never printed)."""

    key: bytes = field(repr=False)
    source: str

    def proof(self, label: str, *parts: bytes | str) -> bytes:
        """HMAC-SHA256 over ``label`` and ``parts``, each length-prefixed (no two lists collide)."""
        mac = hmac.new(self.key, digestmod=hashlib.sha256)
        for p in (label, *parts):
            b = p.encode() if isinstance(p, str) else bytes(p)
            mac.update(len(b).to_bytes(4, "big") + b)
        return mac.digest()

    def answer(self, role: str, theirs: bytes, mine: bytes, me: str, them: str) -> bytes:
        """``me``'s proof, in ``role`` ("initiator" or "responder"), over ``them``'s nonce ``theirs`` (and its
        own ``mine``, b"" where it sends none): what every handshake below sends and checks."""
        return self.proof(role, theirs, mine, me, them)

    def check(self, expected: bytes, got) -> bool:
        return isinstance(got, bytes) and hmac.compare_digest(expected, got)

    def sign(self, key: str, value: bytes) -> bytes:
        return SIGNED + self.proof("store", key, value) + value

    def open(self, key: str, blob: bytes) -> bytes:
        """The value of a signed ``blob`` stored under ``key``; AuthError if the job's secret did not sign it."""
        tag, value = blob[len(SIGNED):len(SIGNED) + 32], blob[len(SIGNED) + 32:]
        if not blob.startswith(SIGNED) or not self.check(self.proof("store", key, value), tag):
            raise AuthError(f"the store's value of {key!r} is not signed with the job's secret: a process "
                            f"outside the job wrote it", op="connect")
        return value


def load(env=None) -> JobSecret | None:
    """The job's secret from ``env`` (default: this process's environment), or None when it names none.
    ConfigError, in one line, for a file others may read, a missing file, or a secret too short."""
    env = os.environ if env is None else env
    path, text = env.get(SECRET_FILE_ENV, ""), env.get(SECRET_ENV, "")
    if path:
        try:
            fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
        except OSError as exc:
            raise ConfigError(f"{SECRET_FILE_ENV}={path}: cannot open it ({exc.strerror})") from None
        try:
            st = os.fstat(fd)
            if st.st_uid != os.getuid() or st.st_mode & 0o077 or not stat.S_ISREG(st.st_mode):
                raise ConfigError(f"{SECRET_FILE_ENV}={path}: a job secret must be a file of this user that no "
                                  f"one else may read (chmod 600), its mode is {oct(st.st_mode & 0o777)}")
            key = os.read(fd, 4096).strip()
        finally:
            os.close(fd)
        source = f"file {path}"
    elif text:
        key, source = text.encode(), f"${SECRET_ENV}"
    else:
        return None
    if len(key) < MIN_SECRET:
        raise ConfigError(f"the job secret from {source} has {len(key)} bytes; it needs at least {MIN_SECRET}")
    return JobSecret(key, source)


def create_file(folder: str) -> str:
    """A fresh secret (32 random bytes, hex) in ``folder``/job.secret, mode 0600; its path."""
    path = os.path.join(folder, "job.secret")
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    try:
        os.write(fd, os.urandom(32).hex().encode())
    finally:
        os.close(fd)
    return path


def describe(secret: JobSecret | None) -> str:
    """What the facts and stats say about authentication."""
    if secret is None:
        return f"none: no job secret (set {SECRET_FILE_ENV} or {SECRET_ENV}; commlab run/train make one)"
    return f"job secret ({secret.source})"


def warn_unauthenticated(who: str) -> None:
    """Say on stderr that ``who`` runs without a job secret (anyone on this host may connect)."""
    print(f"commlab: WARNING: {who} runs without a job secret: any local process that finds its ports may "
          f"connect. Set {SECRET_FILE_ENV} (a 0600 file) or {SECRET_ENV} in every rank's and server's "
          f"environment (commlab run/train do it for you)", file=sys.stderr, flush=True)


# ----- signed store values ----------------------------------------------------------------------------
def put(store, secret: JobSecret | None, key: str, value: str | bytes) -> None:
    """``store.set(key, value)``, signed when the job has a secret."""
    b = value.encode() if isinstance(value, str) else value
    store.set(key, secret.sign(key, b) if secret is not None else b)


def get(store, secret: JobSecret | None, key: str) -> bytes:
    """``store.get(key)``'s value, checked against the job's secret (AuthError naming the key if forged)."""
    blob = store.get(key)
    return secret.open(key, blob) if secret is not None else blob


# ----- the handshake ------------------------------------------------------------------------------------
def pack(msg: dict) -> bytes:
    return msgpack.packb({"auth": 1, **msg}, use_bin_type=True)


def unpack(raw, what: str) -> dict:
    """A handshake message (a map with ``auth: 1``), or AuthError naming ``what`` it should have been."""
    b = bytes(raw)
    if len(b) > MAX_MESSAGE:
        raise AuthError(f"{what}: a {len(b)}-byte message is no handshake")
    try:
        msg = msgpack.unpackb(b, raw=False, max_bin_len=MAX_MESSAGE, max_str_len=MAX_MESSAGE,
                              max_array_len=8, max_map_len=8)
    except Exception:
        raise AuthError(f"{what}: not a handshake message") from None
    if not isinstance(msg, dict) or msg.get("auth") != 1:
        raise AuthError(f"{what}: not a handshake message")
    return msg


def is_handshake(raw) -> bool:
    """Whether ``raw`` looks like a handshake message (a cheap check before :func:`unpack`)."""
    try:
        return len(raw) <= MAX_MESSAGE and b"\xa4auth" in bytes(raw)[:16]
    except TypeError:
        return False


def _nonce(msg: dict, what: str) -> bytes:
    n = msg.get("nonce")
    if not isinstance(n, bytes) or len(n) != NONCE:
        raise AuthError(f"{what}: no {NONCE}-byte nonce")
    return n


def _who(msg: dict, what: str) -> str:
    w = msg.get("who")
    if not isinstance(w, str) or not 0 < len(w) <= 128:
        raise AuthError(f"{what}: no name")
    return w


class Initiator:
    """The side that connects: :meth:`hello`, then :meth:`prove` with the responder's answer, then
    :meth:`done` with its last word. Each raises AuthError when the peer does not prove the secret."""

    def __init__(self, secret: JobSecret, who: str, peer: str):
        self.secret, self.who, self.peer = secret, who, peer
        self.nonce = os.urandom(NONCE)

    def hello(self) -> bytes:
        return pack({"nonce": self.nonce, "who": self.who})

    def prove(self, raw) -> bytes:
        what = f"{self.peer}'s handshake"
        msg = unpack(raw, what)
        if "refused" in msg:
            raise AuthError(f"{self.peer} refused the handshake: {str(msg['refused'])[:200]}")
        theirs, name = _nonce(msg, what), _who(msg, what)
        if not self.secret.check(self.secret.answer("responder", self.nonce, theirs, name, self.who), msg.get("proof")):
            raise AuthError(f"{self.peer} did not prove the job's secret: it is not this job's process")
        self.peer_name = name
        return pack({"proof": self.secret.answer("initiator", theirs, self.nonce, self.who, name)})

    def done(self, raw) -> str:
        msg = unpack(raw, f"{self.peer}'s handshake")
        if msg.get("ok") is not True:
            raise AuthError(f"{self.peer} refused the handshake: {str(msg.get('refused'))[:200]}")
        return self.peer_name


class Responder:
    """The side that accepts: :meth:`challenge` with the initiator's hello, :meth:`check` with its proof
    (then the initiator is known as :attr:`peer_name`). Each raises AuthError on a bad message."""

    def __init__(self, secret: JobSecret, who: str):
        self.secret, self.who = secret, who
        self.nonce = os.urandom(NONCE)
        self.theirs: bytes | None = None
        self.peer_name = ""

    def challenge(self, raw) -> bytes:
        msg = unpack(raw, "a handshake's hello")
        self.theirs, self.peer_name = _nonce(msg, "a handshake's hello"), _who(msg, "a handshake's hello")
        return pack({"nonce": self.nonce, "who": self.who,
                     "proof": self.secret.answer("responder", self.theirs, self.nonce, self.who, self.peer_name)})

    def check(self, raw) -> bytes:
        if self.theirs is None:
            raise AuthError("a handshake's proof before its hello")
        msg = unpack(raw, f"{self.peer_name}'s handshake proof")
        expected = self.secret.answer("initiator", self.nonce, self.theirs, self.peer_name, self.who)
        if not self.secret.check(expected, msg.get("proof")):
            raise AuthError(f"{self.peer_name!r} did not prove the job's secret")
        return pack({"ok": True})


class Offer:
    """The same proofs where the responder's nonce reaches the initiator beforehand, in a signed store value
    (the ring's links: a rank offers its end with :attr:`nonce`, its neighbour connects later). Two messages
    instead of four, so that neither side waits on the other inside one phase of a ring's meeting:
    :meth:`claim` (the initiator's nonce, name and proof over the offer's nonce), answered by :meth:`grant`
    (the responder's proof over the initiator's nonce), which the initiator checks with :meth:`granted`."""

    def __init__(self, secret: JobSecret, nonce: bytes | None = None):
        self.secret = secret
        self.nonce = os.urandom(NONCE) if nonce is None else nonce

    def claim(self, offered: bytes, me: str, them: str) -> bytes:
        """The initiator's message, for an offer of nonce ``offered`` by ``them``; keeps its own nonce."""
        return pack({"nonce": self.nonce, "who": me, "proof": self.secret.answer("initiator", offered, self.nonce,
                                                                                me, them)})

    def grant(self, raw, me: str, them: str) -> bytes:
        """The responder's answer to a claim that ``them`` made over this offer; AuthError if it does not prove
        the secret as ``them``."""
        msg = unpack(raw, f"{them}'s handshake")
        theirs, name = _nonce(msg, f"{them}'s handshake"), _who(msg, f"{them}'s handshake")
        if name != them or not self.secret.check(self.secret.answer("initiator", self.nonce, theirs, name, me),
                                                  msg.get("proof")):
            raise AuthError(f"a connection claiming to be {them} did not prove the job's secret")
        return pack({"proof": self.secret.answer("responder", theirs, self.nonce, me, them)})

    def granted(self, raw, offered: bytes, me: str, them: str) -> None:
        """Check the responder's answer to our claim; AuthError if it is not ``them`` of this job."""
        msg = unpack(raw, f"{them}'s handshake")
        if not self.secret.check(self.secret.answer("responder", self.nonce, offered, them, me), msg.get("proof")):
            raise AuthError(f"{them} did not prove the job's secret")


def refusal(why: str) -> bytes:
    return pack({"refused": why})


def initiate(secret: JobSecret, who: str, peer: str, send, recv) -> str:
    """The initiator's whole handshake over a blocking ``send(bytes)`` / ``recv() -> bytes`` pair (each
    bounded by the caller); the responder's name."""
    side = Initiator(secret, who, peer)
    send(side.hello())
    send(side.prove(recv()))
    return side.done(recv())


def respond(secret: JobSecret, who: str, send, recv) -> str:
    """The responder's whole handshake (as :func:`initiate`); the initiator's name. On a bad message
    the peer is told it was refused (best effort) and AuthError raised."""
    side = Responder(secret, who)
    try:
        send(side.challenge(recv()))
        send(side.check(recv()))
    except AuthError as exc:
        try:
            send(refusal(str(exc)))
        except OSError:
            pass
        raise
    return side.peer_name
