"""Placement planning: traces, the cost model, the planner and the plan it returns."""

from hetstore.planner.cost import Estimate, UnitChoice, estimate
from hetstore.planner.plan import Capacities, Plan, UnitPlan
from hetstore.planner.planner import make_plan
from hetstore.planner.trace import MachineRates, Trace, UnitTrace

__all__ = [
    "Capacities",
    "Estimate",
    "MachineRates",
    "Plan",
    "Trace",
    "UnitChoice",
    "UnitPlan",
    "UnitTrace",
    "estimate",
    "make_plan",
]
