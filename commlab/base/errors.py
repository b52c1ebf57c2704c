"""The typed errors of commlab.

Everything that goes wrong between processes is a ``CommError``; callers who
only want to know "did the exchange fail" catch that. The children say how it
failed. Every message names the rank, shard or key at fault, because a stalled
job with eight workers is only debuggable if the error says who stalled.

Caller mistakes (a bad URL, a wrong shape handed to an API) are ``ValueError``
subclasses instead: they are bugs in the calling code, not faults of the
network.
"""

from __future__ import annotations


class CommError(RuntimeError):
    """Root of every communication failure.

    Fields, for callers to branch on (never on the message text):

    - ``peer``: the rank (an int) or shard (a str) at fault: the one that was lost, stalled or lied;
      None when nobody in particular is.
    - ``origin``: the rank that saw the failure first, when this error relays its report (read from
      the rendezvous store); None when this process saw it itself.
    - ``op``: what this process was doing when it failed: ``"receive"``, ``"send"``, ``"connect"``
      (None: not said).
    """

    def __init__(self, message: str = "", *, peer: int | str | None = None, origin: int | None = None,
                 op: str | None = None):
        super().__init__(message)
        self.peer, self.origin, self.op = peer, origin, op

    def fields(self) -> dict:
        return {"peer": self.peer, "origin": self.origin, "op": self.op}

    def reworded(self, message: str) -> "CommError":
        """The same kind of error with the same fields and another message (to add context)."""
        return type(self)(message, **self.fields())

    def __reduce__(self):  # keep the fields across pickling (multiprocessing hands errors between processes)
        return _rebuild, (type(self), str(self), self.fields())


class CommTimeout(CommError, TimeoutError):
    """A wait ran past its deadline. The message names who never answered."""


class PeerLost(CommError):
    """A peer (rank or server shard) went away while we depended on it."""


class ProtocolError(CommError):
    """A message broke the wire protocol: bad header, frame, size or dtype.

    ``where`` (a field, besides CommError's): the part of the message or blob that lied, when one is named
    (``state['opt'][0]`` in a committed state); None otherwise."""

    def __init__(self, message: str = "", *, where: str | None = None, **fields):
        super().__init__(message, **fields)
        self.where = where

    def fields(self) -> dict:
        return {**super().fields(), "where": self.where}


class AuthError(ProtocolError):
    """A peer did not prove the job's secret (:mod:`commlab.transport.auth`), or a store value is not signed with it:
    a process outside the job, never one of its ranks."""


class RemoteError(CommError):
    """A peer understood the request and refused it; its reason is the message."""


class BackendUnavailable(CommError):
    """The asked-for backend (NCCL, CUDA, CURVE...) cannot run here.

    commlab never falls back silently: this is raised instead.
    """


class ConfigError(ValueError):
    """A configuration, URL or environment that cannot work. Fails fast."""


class ModelMismatch(ConfigError):
    """Ranks disagree about the model (names, shapes or dtypes)."""


def from_torch(exc: BaseException, otherwise: type[CommError] = CommError) -> tuple[type[CommError], str]:
    """How an exception torch.distributed raised while waiting for a ``Work`` (a collective, an isend or
    irecv) maps onto this hierarchy, and its first line, for the message: the one rule every regime uses.

    By type where torch says it: a ``TimeoutError`` (torch's ``DistTimeoutError`` is one) is a timeout;
    ``DistNetworkError`` (a socket to a peer failed) is a lost peer. gloo raises a plain ``RuntimeError``
    (or ``DistBackendError``) for both, so for those its words decide: "timed out"/"timeout" is a timeout;
    a closed, reset or refused connection is a lost peer; anything else is ``otherwise`` (a point-to-point
    wait knows its peer and says ``PeerLost``; a collective says ``CommError``)."""
    text = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
    network = getattr(_torch_distributed(), "DistNetworkError", ())
    low = text.lower()
    if isinstance(exc, TimeoutError) or "timed out" in low or "timeout" in low:
        return CommTimeout, text
    if (network and isinstance(exc, network)) or any(w in low for w in ("connection", "closed", "reset by peer")):
        return PeerLost, text
    return otherwise, text


def _torch_distributed():
    try:
        import torch.distributed as dist
    except ImportError:  # a build without torch.distributed: nothing to classify by type
        return None
    return dist


def _rebuild(cls, message: str, fields: dict) -> CommError:
    return cls(message, **fields)
