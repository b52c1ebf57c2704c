"""commlab: one Exchanger contract, many gradient-exchange regimes."""

from commlab.base.errors import (BackendUnavailable, CommError, CommTimeout, ConfigError, ModelMismatch, PeerLost,
                            ProtocolError, RemoteError)
from commlab.core.ddp import ddp_hook
from commlab.core.exchanger import Exchanger, StepReport
from commlab.core.metrics import report
from commlab.core.optim import OptimizerSpec
from commlab.core.registry import connect

__version__ = "0.1.0"
__all__ = ["connect", "ddp_hook", "report", "Exchanger", "StepReport", "OptimizerSpec", "CommError", "CommTimeout", "PeerLost",
           "ProtocolError", "RemoteError", "BackendUnavailable", "ConfigError", "ModelMismatch"]
