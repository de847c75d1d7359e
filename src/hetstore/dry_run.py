"""``hetstore.plan``: where everything would go and how fast, before a byte is allocated."""

from __future__ import annotations

from collections.abc import Sequence

from torch import nn

from hetstore.config import OffloadConfig
from hetstore.errors import ConfigError
from hetstore.planner import Plan, UnitChoice, make_plan
from hetstore.planner.machine import machine_capacities, measure_machine
from hetstore.planner.probe import Probe
from hetstore.planner.trace import MachineRates
from hetstore.planner.tracer import trace_model

__all__ = ["plan"]


def plan(
    model: nn.Module,
    example_inputs,
    config: OffloadConfig | None = None,
    *,
    optimizer=None,
    units: Sequence[nn.Module] | None = None,
    machine: MachineRates | None = None,
    probe: bool | None = None,
    probe_budget_s: float | None = 2.0,
) -> Plan:
    """The placement plan for training ``model`` on ``example_inputs`` under ``config``.

    ``model`` may live on the meta device (built under ``torch.device("meta")``): it is
    traced on fake or meta tensors, so none of it is allocated. ``example_inputs`` are
    the arguments of one forward (a tensor or a tuple; meta tensors with the batch's
    shapes and dtypes will do). ``machine``: rates to plan with instead of measuring this
    machine (another machine's, or made up).

    ``probe``: to predict the step time, one unit of each kind (one transformer block)
    runs its forward and backward for real at the batch's shapes, on random tensors, a
    few times (:mod:`hetstore.planner.probe`), unless the FLOP estimate says one run
    would take longer than ``probe_budget_s`` (None: always). Default: probe when
    ``machine`` is measured here, not when it is given; without a probe compute comes
    from FLOPs. The plan says how its compute time was obtained and how far to trust
    each figure.

    With ``auto_offload`` the planner chooses (and refuses with each short tier's need
    when nothing fits); otherwise the ``offload_*`` keys' placement is predicted as is.
    Print the result for a table; ``Plan.save`` writes JSON.
    """
    config = config if config is not None else OffloadConfig(auto_offload=True)
    if not isinstance(config, OffloadConfig):
        raise ConfigError(f"config must be a hetstore.OffloadConfig, got {type(config).__name__}")
    device = config.resolved_device()
    if probe is None:
        probe = machine is None  # this machine's rates: its compute can be timed too
    if machine is None:
        machine = measure_machine(device, config.offload_path, config.optimizer_state_format)
    trace = trace_model(
        model,
        example_inputs,
        config,
        machine,
        optimizer=optimizer,
        units=units,
        probe=Probe(device, probe_budget_s) if probe else None,
    )
    capacities = machine_capacities(config, device)
    if config.auto_offload:
        return make_plan(trace, capacities, config)
    choice = UnitChoice(config.offload_param, config.offload_optimizer, config.offload_activations)
    return Plan.uniform(
        trace, choice, config.prefetch_depth, capacities, chunk_bytes=config.optimizer_chunk_size
    )
