"""Compact optimizer states (``optimizer_state_format``): bf16 and 8-bit block-wise.

Exactness here means: the compact formats step bit for bit as an independent reference
of the same arithmetic (decode, torch's fused AdamW on the fp32 values, encode) written
below without hetstore's code, in memory and on disk, whatever the chunk size; they
resume bitwise from checkpoints; fp32 stays plain PyTorch (every other test file).
"""

from __future__ import annotations

import pytest
import torch

import hetstore
from hetstore.demo.gpt import GPT
from hetstore.errors import ConfigError
from hetstore.optim import state_format as sf

E4M3 = torch.float8_e4m3fn


# ---------------------------------------------------------------- the reference 8-bit code
def _e4m3_values() -> torch.Tensor:
    """The 128 non-negative finite e4m3 values, in code order (float64)."""
    codes = torch.arange(128, dtype=torch.int32).to(torch.uint8).view(E4M3)
    values = codes.to(torch.float64)
    return values[torch.isfinite(values)]


def _nearest_e4m3(x: torch.Tensor) -> torch.Tensor:
    """Round non-negative fp32 ``x`` to the nearest e4m3 value, ties to the even code,
    by exhaustive search in float64 (no cast of torch's involved)."""
    grid = _e4m3_values()
    distance = (x.double()[:, None] - grid[None, :]).abs()
    best = distance.min(dim=1, keepdim=True).values
    ties = distance == best
    index = torch.arange(grid.numel()).expand_as(ties)
    # among the nearest (at most two), the even code
    even = ties & (index % 2 == 0)
    pick = torch.where(even.any(dim=1), (even * (index + 1)).amax(dim=1) - 1, ties.int().argmax(1))
    return grid[pick].float()


def reference_encode(key: str, values: torch.Tensor):
    """(stored values as fp32, scales) of the 8-bit format, per 256-element block."""
    second = key.endswith("exp_avg_sq")
    x = values.clamp(min=0).sqrt() if second else values.clone()
    stored = torch.empty_like(x)
    scales = []
    for a in range(0, x.numel(), 256):
        block = x[a : a + 256]
        scale = block.abs().max()
        scales.append(scale)
        scaled = block * (256.0 / scale) if scale > 0 else torch.zeros_like(block)
        if second:
            scaled = scaled.clamp(min=2.0**-9)
        stored[a : a + 256] = _nearest_e4m3(scaled.abs()) * torch.sign(scaled)
    return stored, torch.stack(scales)


def reference_decode(key: str, stored: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    out = torch.empty_like(stored)
    for i, a in enumerate(range(0, stored.numel(), 256)):
        out[a : a + 256] = stored[a : a + 256] * (scales[i] / 256.0)
    return out.square() if key.endswith("exp_avg_sq") else out


@pytest.mark.parametrize("key", ["exp_avg", "exp_avg_sq"])
def test_8bit_codes_equal_a_reference_quantizer_bitwise(key):
    torch.manual_seed(0)
    values = torch.randn(1000) * torch.logspace(-12, 0, 1000)  # 12 decades in a block
    if key == "exp_avg_sq":
        values = values.square()
    values[300:556] = 0.0  # a whole zero block
    values[5] = 0.0
    fmt = sf.state_format("8bit")
    codes = torch.empty(1000, dtype=E4M3)
    scales = torch.empty(sf.blocks(1000))
    sf.encode(fmt, key, values.clone(), codes, scales)
    want, want_scales = reference_encode(key, values)
    assert torch.equal(scales, want_scales)
    assert torch.equal(codes.float(), want)
    decoded = torch.empty(1000)
    sf.decode(fmt, key, codes, scales, decoded)
    assert torch.equal(decoded, reference_decode(key, want, want_scales))
    # the rounding the format promises: 3 mantissa bits, within 1/16 of each value that
    # is within 2^-6 of its block's largest (below that e4m3 is subnormal and coarser)
    big = values.abs() > values.abs().max() * 2.0**-6
    root = values.sqrt() if key == "exp_avg_sq" else values
    err = ((decoded.sqrt() if key == "exp_avg_sq" else decoded) - root).abs()
    assert (err[big] <= root.abs()[big] / 16 * 1.0001).all()
    if key == "exp_avg_sq":  # a second moment is never rounded to zero
        assert (decoded[values > 0] > 0).all()


# ---------------------------------------------------------------- training
def _model():
    torch.manual_seed(0)
    return GPT(vocab=128, width=64, depth=2, heads=4, ctx=32)


def _offload(fmt: str, tier: str, tmp_path, chunk: int = 32 * 2**20, grad=None):
    model = _model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    config = hetstore.OffloadConfig(
        offload_param=tier,
        offload_optimizer=tier,
        offload_grad=grad,
        optimizer_state_format=fmt,
        optimizer_chunk_size=chunk,
        offload_path=str(tmp_path / f"offload-{fmt}-{tier}-{chunk}"),
        enable_pinned_mem=False,
    )
    return hetstore.offload(model, opt, config)


def _batches(n: int, seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 128, (4, 32), generator=g) for _ in range(n)]


class ReferenceCompactAdamW:
    """The compact formats' arithmetic without hetstore: each unit's trainable
    parameters as one flat fp32 master in hetstore's layout (offsets from the units),
    states stored with the reference code above, stepped per segment by torch's fused
    AdamW on the decoded values."""

    def __init__(self, model, fmt: str, hyper: dict):
        self.fmt, self.hyper = fmt, hyper
        self.units = []
        names = {id(p): n for n, p in model.named_parameters()}
        weights = model.state_dict()  # (a released unit's parameters have no storage)
        for unit in hetstore.state_of(model).runtime.units:
            if not unit.trainable_numel:
                continue
            n = unit.trainable_numel
            master = torch.zeros(n)
            for e in unit.trainable_entries:
                master[e.offset : e.offset + e.numel] = weights[names[id(e.param)]].reshape(-1)
            states = {k: self._encode(k, torch.zeros(n)) for k in ("exp_avg", "exp_avg_sq")}
            self.units.append((unit, master, states, [s for s in unit.segments]))
        self.steps = 0

    def _encode(self, key, values):
        if self.fmt == "bf16":
            return values.to(torch.bfloat16)
        return reference_encode(key, values)

    def _decode(self, key, stored):
        if self.fmt == "bf16":
            return stored.float()
        return reference_decode(key, *stored)

    def step(self, grads: dict[int, torch.Tensor]) -> None:
        self.steps += 1
        for unit, master, states, segments in self.units:
            grad = torch.zeros_like(master)
            for e in unit.trainable_entries:
                grad[e.offset : e.offset + e.numel] = grads[id(e.param)].reshape(-1)
            decoded = {k: self._decode(k, v) for k, v in states.items()}
            for seg in segments:
                p = master[seg.start : seg.end].clone().requires_grad_()
                p.grad = grad[seg.start : seg.end].clone()
                opt = torch.optim.AdamW([p], fused=True, **self.hyper)
                opt.state[p] = {
                    "step": torch.tensor(float(self.steps - 1)),
                    **{k: v[seg.start : seg.end].clone() for k, v in decoded.items()},
                }
                opt.step()
                master[seg.start : seg.end] = p.detach()
                for k in decoded:
                    decoded[k][seg.start : seg.end] = opt.state[p][k]
            for k in states:
                states[k] = self._encode(k, decoded[k])

    def weights(self) -> dict[int, torch.Tensor]:
        out = {}
        for unit, master, _, _ in self.units:
            for e in unit.trainable_entries:
                out[id(e.param)] = master[e.offset : e.offset + e.numel].view(e.shape)
        return out


@pytest.mark.parametrize(
    "fmt,tier,chunk",
    [("8bit", "cpu", 32 * 2**20), ("8bit", "disk", 64 * 1024), ("bf16", "disk", 32 * 2**20)],
)
def test_compact_adamw_steps_bitwise_as_the_reference(fmt, tier, chunk, tmp_path):
    """The same gradients (read through p.grad each step) into hetstore's optimizer and
    the reference: the fp32 masters agree bit for bit after 4 steps; the small chunk
    size cuts the units into several chunks (and the disk step runs ahead, overlapped;
    gradients in host memory, where p.grad can be read)."""
    model, opt = _offload(fmt, tier, tmp_path, chunk, grad="cpu")
    reference = ReferenceCompactAdamW(model, fmt, dict(lr=1e-2, weight_decay=0.01))
    for x in _batches(4):
        model(x, x).backward()
        grads = {id(p): p.grad.detach().clone() for p in model.parameters()}
        opt.step()
        opt.zero_grad()
        reference.step(grads)
    want = reference.weights()
    names = {id(p): n for n, p in model.named_parameters()}
    saved = model.state_dict()
    for key, value in want.items():
        assert torch.equal(saved[names[key]], value), names[key]


def _train(model, opt, batches) -> list[float]:
    losses = []
    for x in batches:
        loss = model(x, x)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


@pytest.mark.parametrize("fmt", ["bf16", "8bit"])
def test_compact_states_are_the_same_on_every_tier_and_chunk_size(fmt, tmp_path):
    results = []
    for tier, chunk in (("cpu", 32 * 2**20), ("disk", 32 * 2**20), ("disk", 64 * 1024)):
        model, opt = _offload(fmt, tier, tmp_path, chunk)
        _train(model, opt, _batches(4))
        results.append(model.state_dict())
    for other in results[1:]:
        assert all(torch.equal(results[0][k], other[k]) for k in other)


@pytest.mark.parametrize("fmt", ["bf16", "8bit"])
@pytest.mark.parametrize("saved_on,loaded_on", [("cpu", "disk"), ("disk", "cpu")])
def test_compact_states_resume_bitwise_from_a_checkpoint(fmt, saved_on, loaded_on, tmp_path):
    batches = _batches(6)
    model, opt = _offload(fmt, saved_on, tmp_path)
    _train(model, opt, batches[:3])
    hetstore.save(tmp_path / "ckpt", model, opt)
    _train(model, opt, batches[3:])
    want = model.state_dict()
    resumed, opt2 = _offload(fmt, loaded_on, tmp_path)
    hetstore.load(tmp_path / "ckpt", resumed, opt2)
    _train(resumed, opt2, batches[3:])
    got = resumed.state_dict()
    assert all(torch.equal(want[k], got[k]) for k in want)


def test_another_format_is_refused_unless_converted(tmp_path):
    model, opt = _offload("8bit", "cpu", tmp_path)
    _train(model, opt, _batches(2))
    hetstore.save(tmp_path / "ckpt", model, opt)
    other, opt32 = _offload("fp32", "cpu", tmp_path)
    before = {k: v.clone() for k, v in other.state_dict().items()}
    with pytest.raises(ConfigError, match=r"'8bit'.*'fp32'.*convert_state_format=True"):
        hetstore.load(tmp_path / "ckpt", other, opt32)
    assert all(torch.equal(before[k], v) for k, v in other.state_dict().items())
    hetstore.load(tmp_path / "ckpt", other, opt32, convert_state_format=True)
    assert all(torch.equal(model.state_dict()[k], v) for k, v in other.state_dict().items())
    # torch's format: the decoded fp32 values, and the format they came from
    saved = opt.state_dict()
    assert saved["state_format"] == "8bit"
    assert saved["state"][0]["exp_avg"].dtype == torch.float32
    with pytest.raises(ValueError, match=r"state_dict\['state_format'\] = 'fp32'"):
        opt32.load_state_dict(saved)


def test_bad_format_and_unsupported_optimizer_are_refused_before_any_work(tmp_path):
    with pytest.raises(ConfigError, match=r"optimizer_state_format='int8'.*'fp32', 'bf16', '8bit'"):
        hetstore.OffloadConfig(optimizer_state_format="int8")
    model = _model()
    before = [p.detach().clone() for p in model.parameters()]
    opt = torch.optim.RMSprop(model.parameters())
    config = hetstore.OffloadConfig(offload_optimizer="cpu", optimizer_state_format="8bit")
    with pytest.raises(ConfigError, match="RMSprop.*optimizer_state_format='fp32'"):
        hetstore.offload(model, opt, config)
    assert hetstore.state_of(model) is None
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))


@pytest.mark.parametrize("fmt,per_element", [("fp32", 8), ("bf16", 4), ("8bit", 2 + 2 / 64)])
def test_state_bytes_on_disk_and_in_the_plan(fmt, per_element, tmp_path):
    """The bytes the disk tier holds for the states, measured from its regions, are the
    format's; the planner counts the same."""
    model, opt = _offload(fmt, "disk", tmp_path)
    units = hetstore.state_of(model).runtime.units
    held = 0
    for unit in units:
        step = opt.streamed_step_of(unit)
        if step is not None:
            arrays = list(step.states.values()) + list(step.scales.values())
            held += sum(a.region.nbytes for a in arrays)
    trainable = sum(u.trainable_numel for u in units)
    assert held == pytest.approx(trainable * per_element, rel=0.02)
    from hetstore.optim.registry import state_itemsize

    assert state_itemsize(torch.optim.AdamW([torch.zeros(1)]), fmt) == pytest.approx(per_element)
