"""commlab: one Exchanger contract, many gradient-exchange regimes."""

from commlab.errors import (BackendUnavailable, CommError, CommTimeout, ConfigError, ModelMismatch, PeerLost,
                            ProtocolError, RemoteError)
from commlab.ddp import ddp_hook
from commlab.exchanger import Exchanger, StepReport
from commlab.metrics import report
from commlab.optim import OptimizerSpec
from commlab.registry import connect

__version__ = "0.1.0"
__all__ = ["connect", "ddp_hook", "report", "Exchanger", "StepReport", "OptimizerSpec", "CommError", "CommTimeout", "PeerLost",
           "ProtocolError", "RemoteError", "BackendUnavailable", "ConfigError", "ModelMismatch"]
