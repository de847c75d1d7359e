"""auto_offload end to end on CPU: the planner's placement trains like plain PyTorch,
holds every tier's capacity, and its predicted peaks match the measured ones."""

from __future__ import annotations

import pytest
import torch

import hetstore
from hetstore import OffloadConfig, OutOfDeviceMemory
from hetstore.planner import UnitChoice
from hetstore.planner.tracer import trace_model
from tests.api.helpers import SEED_AUTO
from tests.models.gpt import GPT, batches
from tests.parity import TIGHT, adamw, assert_same_weights, pair, run
from tests.planner.helpers import CPU, auto_config

# Measured peaks against predicted ones: the cost model mirrors the runtime's accounting
# but rounds some things (host slices to pages, the gradient in flight as the largest
# parameter's); 20% (the bar) with a 256 KiB floor for the small test tiers.
PEAK_TOLERANCE = 0.2
PEAK_FLOOR = 256 << 10


def deep():
    """Blocks hold most of the states (the root unit never leaves the device)."""
    return GPT(width=64, depth=8)


def states_bytes(model_fn, data):
    model = model_fn()
    return trace_model(model, data[0], OffloadConfig(device="cpu"), CPU).state_bytes


@pytest.mark.parametrize("fraction", [1.0, 0.5, 0.2])
def test_auto_offload_trains_within_budget_and_as_predicted(tmp_path, fraction):
    data = batches(3, batch=8)
    budget = int(states_bytes(deep, data) * fraction)
    ref, mine = pair(deep)
    cfg = auto_config(tmp_path, max_device_memory=budget)
    mine, opt = hetstore.offload(mine, adamw(mine.parameters()), cfg, example_inputs=data[0])
    plan = hetstore.state_of(mine).plan
    print(f"\n{fraction:.0%} of the states: budget {budget} bytes\n{plan}")
    assert plan.source == "auto"
    losses, _ = run(mine, opt, data)
    ref_losses, _ = run(ref, adamw(ref.parameters()), data)
    torch.testing.assert_close(losses, ref_losses, **TIGHT)
    assert_same_weights(ref, mine)
    stats = hetstore.memory_stats(mine)
    assert stats["device"]["peak"] <= budget
    for tier in ("device", "host", "disk"):
        measured, predicted = stats[tier]["peak"], plan.estimate.peak(tier)
        print(f"{tier}: measured peak {measured}, predicted {predicted}")
        assert abs(measured - predicted) <= max(PEAK_TOLERANCE * predicted, PEAK_FLOOR), tier
    if fraction < 1.0:
        assert plan.offloads_anything


def test_a_model_that_fits_is_left_on_the_device(tmp_path):
    data = batches(2)
    _, mine = pair(GPT)
    mine, opt = hetstore.offload(
        mine, adamw(mine.parameters()), auto_config(tmp_path), example_inputs=data[0]
    )
    assert {u.choice for u in hetstore.state_of(mine).plan.units} == {UnitChoice()}
    run(mine, opt, data)


def test_too_small_a_budget_is_refused_before_any_work(tmp_path):
    data = batches(1)
    _, mine = pair(GPT)
    before = [p.detach().clone() for p in mine.parameters()]
    with pytest.raises(OutOfDeviceMemory, match="device: needs at least"):
        hetstore.offload(
            mine,
            adamw(mine.parameters()),
            auto_config(tmp_path, max_device_memory=4096),
            example_inputs=data[0],
        )
    assert hetstore.state_of(mine) is None
    for p, b in zip(mine.parameters(), before, strict=True):
        assert torch.equal(p, b)


def test_the_seeds_auto_config_works_verbatim(tmp_path):
    seed = {**SEED_AUTO, "offload_path": str(tmp_path), "enable_pinned_mem": False}
    data = batches(2)
    budget = states_bytes(deep, data) // 3
    config = OffloadConfig.from_mindspore(seed, max_device_memory=budget, device="cpu")
    ref, mine = pair(deep)
    mine, opt = hetstore.offload(mine, adamw(mine.parameters()), config, example_inputs=data[0])
    losses, _ = run(mine, opt, data)
    ref_losses, _ = run(ref, adamw(ref.parameters()), data)
    torch.testing.assert_close(losses, ref_losses, **TIGHT)
    assert hetstore.memory_stats(mine)["device"]["peak"] <= budget


def test_plan_dry_run_on_the_meta_device(tmp_path):
    """A 7B-parameter GPT on the meta device: planned (about 20 s on two cores), nothing
    allocated."""
    with torch.device("meta"):
        model = GPT(width=4096, depth=32, heads=32, vocab=32000)
    tokens = torch.empty(1, 2048, dtype=torch.long, device="meta")
    cfg = OffloadConfig(
        auto_offload=True,
        max_device_memory="24GB",
        offload_cpu_size="64GB",
        offload_disk_size="2TB",
        offload_path=str(tmp_path),
        device="cpu",
    )
    plan = hetstore.plan(model, (tokens, tokens), cfg, machine=CPU)
    assert sum(p.numel() for p in model.parameters()) > 6e9
    assert plan.estimate.device <= 24 * 2**30 and plan.estimate.host <= 64 * 2**30
    assert plan.offloads_anything
    table = str(plan)
    assert "blocks.31" in table and "predicted step" in table
    plan.save(tmp_path / "plan.json")
    assert hetstore.Plan.load(tmp_path / "plan.json") == plan


def test_cli_plan_prints_the_table_and_refuses_clearly(tmp_path):
    import json
    import subprocess
    import sys

    base = [sys.executable, "-m", "hetstore", "plan", "--device", "cpu", "--width", "256"]
    base += ["--depth", "4", "--vocab", "1000", "--ctx", "128", "--path", str(tmp_path)]
    out = tmp_path / "plan.json"
    done = subprocess.run(
        base + ["--device-memory", "24MB", "--json", str(out)], capture_output=True, text=True
    )
    assert done.returncode == 0, done.stderr
    assert "blocks.3" in done.stdout and "predicted step" in done.stdout
    assert json.loads(out.read_text())["source"] == "auto"
    refused = subprocess.run(base + ["--device-memory", "64KB"], capture_output=True, text=True)
    assert refused.returncode == 1
    assert "device: needs at least" in refused.stderr and "Traceback" not in refused.stderr
    bad = subprocess.run(base + ["--device-memory", "lots"], capture_output=True, text=True)
    assert bad.returncode == 2 and "--device-memory 'lots'" in bad.stderr  # the flag, not the key


def test_the_first_steps_are_profiled_and_recalibrate_the_prediction(tmp_path):
    """After PROFILED_STEPS steps every unit's forward and backward time is known, the
    labels add up to the step, and the calibrated plan predicts from them."""
    from hetstore.api import PROFILED_STEPS

    data = batches(PROFILED_STEPS + 1, batch=8)
    _, mine = pair(deep)
    cfg = auto_config(tmp_path, max_device_memory=states_bytes(deep, data) // 2)
    mine, opt = hetstore.offload(mine, adamw(mine.parameters()), cfg, example_inputs=data[0])
    runtime = hetstore.state_of(mine).runtime
    run(mine, opt, data[:PROFILED_STEPS])
    profile = runtime.profile
    assert profile is not None and runtime.calibrated_plan is not None
    for unit in runtime.plan.units:
        if unit.name.startswith("blocks."):
            assert profile.unit_s(unit.name, "forward") > 0, unit.name
            assert profile.unit_s(unit.name, "backward") > 0, unit.name
    assert profile.of("optimizer") > 0
    assert sum(profile.seconds.values()) == pytest.approx(profile.total_s, rel=1e-6)
    calibrated = runtime.calibrated_plan.estimate
    compute = sum(v for k, v in profile.seconds.items() if isinstance(k, tuple))
    assert calibrated.compute_s == pytest.approx(compute, rel=1e-9)
    assert calibrated.overhead_s == pytest.approx(profile.of("other"))
    # after profiling the hooks stop timing: a later step leaves the profile alone
    run(mine, opt, data[PROFILED_STEPS:])
    assert runtime.profile is profile and not runtime.profiler.active


def test_a_larger_batch_than_traced_is_replanned_within_the_budget(tmp_path):
    """Planned for batch 2 with the activations kept; batch 8 does not fit that way, so
    the activations move to host before its forward: a warning, parity with plain
    PyTorch, and the budget held. A batch no placement can hold is refused before its
    forward, and training goes on afterwards."""
    small = batches(1, batch=2)
    big = batches(3, batch=8, seed=1)
    model = deep()
    trace = trace_model(model, small[0], OffloadConfig(device="cpu"), CPU)
    budget = hetstore.planner.estimate(trace, [UnitChoice()] * len(trace.units), 1).device
    budget += budget // 20
    ref, mine = pair(deep)
    cfg = auto_config(tmp_path, max_device_memory=budget)
    mine, opt = hetstore.offload(mine, adamw(mine.parameters()), cfg, example_inputs=small[0])
    runtime = hetstore.state_of(mine).runtime
    assert not runtime.plan.offloads_anything
    with pytest.warns(UserWarning, match="re-planned the placement"):
        losses, _ = run(mine, opt, big)
    assert {u.choice.activations for u in runtime.plan.units} != {"none"}
    ref_losses, _ = run(ref, adamw(ref.parameters()), big)
    torch.testing.assert_close(losses, ref_losses, **TIGHT)
    assert_same_weights(ref, mine)
    assert hetstore.memory_stats(mine)["device"]["peak"] <= budget

    huge = batches(1, batch=4096, seed=2)[0]
    with pytest.raises(OutOfDeviceMemory, match=r"a batch of shapes .* Lower the batch size"):
        mine(*huge)
    losses, _ = run(mine, opt, big[:1])
    ref_losses, _ = run(ref, adamw(ref.parameters()), big[:1])
    torch.testing.assert_close(losses, ref_losses, **TIGHT)


def test_cli_plans_a_hugging_face_config_beside_accelerates_estimate(tmp_path):
    """A 7B Llama config.json (no weights anywhere): planned on the meta device, printed
    with accelerate's estimate-memory beside it; the weights agree (both count 4 bytes
    per fp32 parameter); a bad path is refused clearly."""
    import subprocess
    import sys

    transformers = pytest.importorskip("transformers")
    pytest.importorskip("accelerate")
    config = transformers.LlamaConfig(
        vocab_size=32000,
        hidden_size=4096,
        intermediate_size=11008,
        num_hidden_layers=32,
        num_attention_heads=32,
        num_key_value_heads=32,
    )
    config.to_json_file(str(tmp_path / "config.json"))
    base = [sys.executable, "-m", "hetstore", "plan", "--device", "cpu", "--path", str(tmp_path)]
    base += ["--device-memory", "8GB", "--disk", "200GB", "--ctx", "512"]  # a plan, not a run
    done = subprocess.run(
        base + ["--hf-config", str(tmp_path)], capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr
    out = done.stdout
    assert "LlamaForCausalLM" in out and "6.74B parameters" in out
    assert "model.layers.31" in out and "accelerate estimate-memory" in out
    weights = next(line for line in out.splitlines() if line.startswith("weights"))
    assert weights.split()[1:3] == weights.split()[3:5], weights  # same bytes both sides
    bad = subprocess.run(
        base + ["--hf-config", str(tmp_path / "missing.json")], capture_output=True, text=True
    )
    assert bad.returncode == 2 and "--hf-config" in bad.stderr and "Traceback" not in bad.stderr


def test_host_peak_with_activations_on_disk_is_predicted_within_ten_percent(tmp_path):
    """The benchmarks/planner.py GPT at 20% of its states on the device and 100% on
    host: the plan sends activations to disk and keeps others on host. The cost model
    had summed every host unit's activations with a full window of disk staging, two
    moments that never coincide (measured 0.62 of the prediction); the host peak is now
    predicted within 10%, and never under."""
    from hetstore.demo.gpt import GPT as DemoGPT
    from hetstore.planner.tracer import model_data_trace

    def build():
        torch.manual_seed(0)
        return DemoGPT(width=256, depth=8, vocab=512, ctx=128)

    states = model_data_trace(build(), OffloadConfig(device="cpu"), None).state_bytes
    model = build()
    cfg = OffloadConfig(
        auto_offload=True,
        device="cpu",
        offload_path=str(tmp_path),
        enable_pinned_mem=False,
        max_device_memory=int(states * 0.2),
        offload_cpu_size=int(states * 1.0),
    )
    gen = torch.Generator().manual_seed(1)
    x, y = (torch.randint(0, 512, (8, 128), generator=gen) for _ in range(2))
    model, opt = hetstore.offload(model, adamw(model.parameters()), cfg, example_inputs=x)
    for _ in range(2):
        model(x, y).backward()
        opt.step()
        opt.zero_grad()
    plan = hetstore.state_of(model).plan
    assert any(u.choice.activations == "disk" for u in plan.units)
    assert any(u.choice.activations == "cpu" for u in plan.units)
    stats = hetstore.memory_stats(model)
    print(plan)
    for tier in ("host", "disk"):
        measured, predicted = stats[tier]["peak"], plan.estimate.peak(tier)
        # where the disk has room, the step ahead takes more than the plan must have:
        # disk shadows kept until optimizer.step()
        e = plan.estimate
        room = e.disk_shadows if tier == "disk" else 0
        print(f"{tier}: measured {measured}, predicted {predicted} (+{room} with room)")
        assert 0.9 * predicted <= measured <= predicted + room, tier
    hetstore.release(model)
