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
    """Root of every communication failure."""


class CommTimeout(CommError, TimeoutError):
    """A wait ran past its deadline. The message names who never answered."""


class PeerLost(CommError):
    """A peer (rank or server shard) went away while we depended on it."""


class ProtocolError(CommError):
    """A message broke the wire protocol: bad header, frame, size or dtype."""


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
