"""commlab: one Exchanger contract, many gradient-exchange regimes."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from commlab.base.errors import (BackendUnavailable, CommError, CommTimeout, ConfigError, ModelMismatch, PeerLost,
                            ProtocolError, RemoteError)

if TYPE_CHECKING:
    from commlab.core.ddp import ddp_hook
    from commlab.core.exchanger import Exchanger, StepReport
    from commlab.core.metrics import report
    from commlab.core.optim import OptimizerSpec
    from commlab.core.registry import connect

__version__ = "0.1.0"
__all__ = ["connect", "ddp_hook", "report", "Exchanger", "StepReport", "OptimizerSpec", "CommError", "CommTimeout", "PeerLost",
           "ProtocolError", "RemoteError", "BackendUnavailable", "ConfigError", "ModelMismatch"]

# The library's entry points import torch (seconds): they are imported on first use (PEP 562), so a process
# that needs none of them (``commlab plan`` answering from its cache, ``commlab keys``) never pays for it.
_LAZY = {"ddp_hook": "commlab.core.ddp", "Exchanger": "commlab.core.exchanger", "StepReport": "commlab.core.exchanger",
         "report": "commlab.core.metrics", "OptimizerSpec": "commlab.core.optim", "connect": "commlab.core.registry"}


def __getattr__(name: str) -> Any:
    if name not in _LAZY:
        raise AttributeError(f"module 'commlab' has no attribute {name!r}")
    return getattr(importlib.import_module(_LAZY[name]), name)
