"""``commlab plan``: a calibrated cost model and a simulator that say which regime wins at N workers.

:mod:`~commlab.plan.costmodel` (the constants and closed forms), :mod:`~commlab.plan.calibrate`
(measuring them here), :mod:`~commlab.plan.simulate` (a step over the bucket timeline, per regime),
:mod:`~commlab.plan.recommend` (sweeps, tables, plots, the recommendation). See docs/plan.md.
"""

from commlab.plan.costmodel import Calibration, Regime, Straggler, Topology, parse_regime
from commlab.plan.simulate import SimResult, simulate

__all__ = ["Calibration", "Regime", "SimResult", "Straggler", "Topology", "parse_regime", "simulate"]
