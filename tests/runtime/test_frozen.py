"""Frozen parameters inside a unit: kept on the device until backward has left the unit,
never rewritten by a step (PEFT LoRA, a frozen LayerNorm inside a block).

Reference: plain PyTorch with torch's fused AdamW over the trainable parameters. Tolerance
TIGHT (fp32 round-off): the same fused kernel on the same fp32 gradients (measured equal).
"""

from __future__ import annotations

import copy

import pytest
import torch
from safetensors import safe_open

import hetstore
from hetstore import OffloadConfig
from hetstore.runtime.rewrite import ChunkedRewrite, Span
from hetstore.tiers.flat import DiskArray
from tests.models.gpt import GPT, batches
from tests.models.hf import build, llama
from tests.parity import TIGHT, assert_same_weights

peft = pytest.importorskip("peft")

PLACEMENTS = ["none", "cpu", "disk"]


def config(param: str, optim: str = "cpu", **kwargs) -> OffloadConfig:
    # gradients in host memory, so torch's gradient APIs work on every placement
    return OffloadConfig(
        offload_param=param,
        offload_optimizer=optim,
        offload_grad="cpu",
        enable_pinned_mem=False,
        device="cpu",
        **kwargs,
    )


def trainable_adamw(model):
    params = [p for p in model.parameters() if p.requires_grad]
    return torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1, fused=True)


def tiny_llama():
    cfg = llama()
    cfg.num_hidden_layers = 3
    return build(cfg)


def lora(model, r: int = 4, targets=("q_proj", "v_proj")):
    cfg = peft.LoraConfig(r=r, lora_alpha=2 * r, target_modules=list(targets), lora_dropout=0.0)
    model = peft.get_peft_model(model, cfg)
    torch.manual_seed(1)  # LoRA's B starts at zero; make it non-zero so A's gradient is too
    for name, p in model.named_parameters():
        if "lora_B" in name:
            torch.nn.init.normal_(p, std=0.02)
    return model


def llama_batches(n):
    g = torch.Generator().manual_seed(0)
    return [torch.randint(0, 128, (2, 16), generator=g) for _ in range(n)]


def train_llama(model, optimizer, data):
    losses = []
    for ids in data:
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        model.zero_grad()
        losses.append(loss.item())
    return losses


def lora_state(model):
    return {n: p.detach().clone() for n, p in model.named_parameters() if "lora_" in n}


@pytest.mark.parametrize("param", PLACEMENTS)
def test_peft_lora_trains_like_plain_pytorch(param):
    ref = lora(tiny_llama())
    mine = copy.deepcopy(ref)
    ref_losses = train_llama(ref, trainable_adamw(ref), llama_batches(4))
    mine, opt = hetstore.offload(mine, trainable_adamw(mine), config(param))
    losses = train_llama(mine, opt, llama_batches(4))
    torch.testing.assert_close(losses, ref_losses, **TIGHT)
    assert_same_weights(ref, mine)


def test_lora_base_on_disk_is_only_read_after_the_first_step():
    """Per step the frozen base is read once for forward and once for backward and never
    written: only the adapters' compute-dtype copy (the head of each unit's layout, up
    to the aligned start of its frozen part) is rewritten on disk; their fp32 master and
    states change in host memory. (Before: every unit's whole home, base included.)"""
    mine = lora(tiny_llama())
    mine, opt = hetstore.offload(mine, trainable_adamw(mine), config("disk"))
    runtime = hetstore.state_of(mine).runtime
    disk = hetstore.state_of(mine).tiers.disk
    data = llama_batches(3)
    train_llama(mine, opt, data[:1])
    read, written = disk.bytes_read, disk.bytes_written
    train_llama(mine, opt, data[1:])
    blocks = sum(u.home_bytes for u in runtime.block_units)
    root = runtime.root.home_bytes
    adapters = sum(u.frozen_start * u.compute_dtype.itemsize for u in runtime.units)
    assert adapters > 0
    assert disk.bytes_written - written == 2 * adapters
    # page-aligned reads: at most one page more per read than the unit's bytes
    per_step = (disk.bytes_read - read) / 2
    assert 2 * blocks + root <= per_step <= 2 * blocks + root + 4096 * (2 * 3 + 1)


class FrozenNormGPT(GPT):
    def __init__(self):
        super().__init__()
        for block in self.blocks:
            block.ln1.requires_grad_(False)  # a frozen LayerNorm inside every block


@pytest.mark.parametrize("param", PLACEMENTS)
def test_block_with_a_frozen_layernorm(param):
    torch.manual_seed(0)
    ref = FrozenNormGPT()
    mine = copy.deepcopy(ref)
    mine, opt = hetstore.offload(mine, trainable_adamw(mine), config(param))
    ref_opt = trainable_adamw(ref)
    for model, optimizer in ((ref, ref_opt), (mine, opt)):
        for x, y in batches(4):
            model(x, y).backward()
            optimizer.step()
            model.zero_grad()
    assert_same_weights(ref, mine)


def test_wholly_frozen_blocks_are_released_during_backward():
    """Freezing the first blocks (a common fine-tune) must not keep them all on the
    device until backward ends: when backward reaches a block, the blocks after it are
    gone (they were kept until the end before: four at once here)."""
    torch.manual_seed(0)
    model = GPT(width=64, depth=6)
    for block in model.blocks[:4]:
        block.requires_grad_(False)
    model, opt = hetstore.offload(model, trainable_adamw(model), config("cpu"))
    units = hetstore.state_of(model).runtime.block_units
    seen = []

    def count(grad):
        seen.append(sum(u.materialized for u in units))

    def hang(module, args, out):  # after hetstore's hook: runs once the block is fetched
        out.register_hook(count)

    for block in model.blocks:
        block.register_forward_hook(hang)
    x, y = batches(1)[0]
    model(x, y).backward()
    assert len(seen) == 6
    assert max(seen) == 1, seen
    assert not any(u.materialized for u in units)


# ---------------------------------------------------------------------- frozen masters
# Frozen parameters already in the compute dtype are stored only in it: no fp32 master
# (Unit.master_numel), never part of a step, saved and loaded from their home.


def bf16_lora(**lora_kwargs):
    """A LoRA model built in bf16 (the usual way to load a base for fine-tuning)."""
    default = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        return lora(tiny_llama(), **lora_kwargs)
    finally:
        torch.set_default_dtype(default)


def frozen_values(model) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in model.named_parameters() if not p.requires_grad}


def master_numel(unit) -> int:
    master = unit.master
    return master.numel if isinstance(master, DiskArray) else master.numel()


@pytest.mark.parametrize(("param", "optim"), [("none", "cpu"), ("disk", "cpu"), ("disk", "disk")])
def test_frozen_bf16_parameters_have_no_fp32_master(tmp_path, param, optim):
    """A bf16 base under bf16 compute: each unit's fp32 master covers only the adapters
    (up to the aligned start of the frozen part), the host tier holds only their bytes,
    training changes the adapters and leaves every frozen value as it was, bit for bit,
    and every placement gives the same losses bit for bit (same arithmetic)."""
    model = bf16_lora()
    before = frozen_values(model)
    opt = trainable_adamw(model)
    cfg = config(param, optim, compute_dtype="bf16", offload_path=str(tmp_path))
    model, opt = hetstore.offload(model, opt, cfg)
    state = hetstore.state_of(model)
    units = state.runtime.units
    for unit in units:
        assert master_numel(unit) == unit.master_numel == unit.frozen_start < unit.numel
    masters = sum(4 * u.master_numel for u in units)
    frozen = sum(4 * (u.numel - u.master_numel) for u in units)
    assert masters * 5 < frozen  # the fp32 copy of the base it no longer has
    if optim == "cpu":
        held = dict(state.tiers.host.account.holders(n=10_000))
        pages = sum(-(-4 * u.master_numel // 4096) * 4096 or 4096 for u in units)
        assert sum(v for k, v in held.items() if k.startswith("master params")) == pages
    losses = train_llama(model, opt, llama_batches(3))
    after = {n: p for n, p in model.state_dict().items() if n in before}
    assert after.keys() == before.keys()
    for name, value in before.items():
        assert torch.equal(after[name].to(value.dtype), value), name
    reference = bf16_lora()
    reference, ref_opt = hetstore.offload(
        reference, trainable_adamw(reference), config("cpu", compute_dtype="bf16")
    )
    assert train_llama(reference, ref_opt, llama_batches(3)) == losses


def test_lora_step_with_states_on_disk_never_writes_the_frozen_base(tmp_path):
    """Master and states of the adapters on disk, the bf16 base on disk: a step writes
    the adapters' master, moments and bf16 copy, and not one byte of the base (before,
    the streamed step copied each unit's frozen part through a shadow of its home, and
    its fp32 master through one of the master: every step)."""
    model = bf16_lora()
    model, opt = hetstore.offload(
        model,
        trainable_adamw(model),
        config("disk", "disk", compute_dtype="bf16", offload_path=str(tmp_path)),
    )
    runtime, disk = hetstore.state_of(model).runtime, hetstore.state_of(model).tiers.disk
    data = llama_batches(3)
    train_llama(model, opt, data[:1])
    written = disk.bytes_written
    train_llama(model, opt, data[1:])
    per_step = (disk.bytes_written - written) / 2
    adapters = sum(
        u.master_numel * 4  # the fp32 master
        + 2 * u.trainable_numel * 4  # AdamW's moments
        + u.master_numel * 2  # the bf16 copy the next forward reads
        for u in runtime.units
    )
    base = sum((u.numel - u.master_numel) * 2 for u in runtime.units)
    assert adapters <= per_step <= adapters + 4096 * len(runtime.units), per_step - adapters
    assert per_step < adapters + base


@pytest.mark.parametrize("optim", ["cpu", "disk"])
def test_checkpoint_of_a_lora_model_resumes_exactly(tmp_path, optim):
    """save -> load into a model whose base differs (so the load must restore it too) ->
    the same losses and weights, bit for bit, as training on without a break. The
    frozen parameters are saved from their home, in the compute dtype."""
    data = llama_batches(4)

    def offloaded(model, where):
        cfg = config("disk", optim, compute_dtype="bf16", offload_path=str(tmp_path / where))
        return hetstore.offload(model, trainable_adamw(model), cfg)

    model, opt = offloaded(bf16_lora(), "a")
    train_llama(model, opt, data[:2])
    hetstore.save(tmp_path / "ckpt", model, opt)
    losses = train_llama(model, opt, data[2:])
    weights = {k: v.clone() for k, v in model.state_dict().items()}
    hetstore.release(model)

    other = bf16_lora()
    with torch.no_grad():
        for p in other.parameters():
            p.add_(1.0)  # nothing of it may survive the load
    other, other_opt = offloaded(other, "b")
    hetstore.load(tmp_path / "ckpt", other, other_opt)
    assert train_llama(other, other_opt, data[2:]) == losses
    for name, value in other.state_dict().items():
        assert torch.equal(value, weights[name]), name

    dtypes = {}
    for f in (tmp_path / "ckpt").rglob("unit-*.safetensors"):
        with safe_open(str(f), "pt") as st:
            for key in st.keys():
                dtypes[key] = st.get_slice(key).get_dtype()
    frozen = [n for n, p in other.named_parameters() if not p.requires_grad]
    assert {dtypes[n] for n in frozen} == {"BF16"}
    assert {dtypes[n] for n, p in other.named_parameters() if p.requires_grad} == {"F32"}


def test_a_failed_rewrite_keeps_the_frozen_part_and_the_next_fetch_rebuilds_the_head(tmp_path):
    """The streamed rewrite of a unit with a master-less frozen part writes the head of
    its disk home in place (a shadow would copy the whole base). A failure after one
    chunk of it was written: the master, the states and the frozen part are untouched,
    the next fetch rebuilds the head from the master, and training goes on exactly as a
    run without the failure."""
    data = llama_batches(3)

    def run(fail: bool):
        # heads of several 2048-element chunks
        model = bf16_lora(r=16, targets=("q_proj", "k_proj", "v_proj", "o_proj"))
        cfg = config("disk", "disk", compute_dtype="bf16", offload_path=str(tmp_path / str(fail)))
        model, opt = hetstore.offload(model, trainable_adamw(model), cfg)
        train_llama(model, opt, data[:1])
        if fail:
            unit = hetstore.state_of(model).runtime.block_units[0]
            assert unit.master_numel >= 2 * 2048
            home_before = torch.empty(unit.numel, dtype=unit.compute_dtype)
            unit.home.read(home_before).wait()
            master_before = unit.master_copy().clone()
            states = opt.streamed_step_of(unit).states
            rewrite = ChunkedRewrite(unit, dict(states))
            assert rewrite.home_in_place
            slots = [
                {name: torch.empty(2048, dtype=dtype) for name, dtype in rewrite.slot_arrays()}
                for _ in range(2)
            ]

            def fill(i, span, slot):
                if i == 1:
                    raise KeyboardInterrupt("stopped in the middle of the rewrite")
                unit.master.read(slot["master"], span.start).wait()
                slot["master"].add_(1.0)  # a new head, written in place into the home
                for key, array in states.items():
                    array.read(slot[key], span.start).wait()

            spans = [Span(a, a + 2048, a + 2048) for a in range(0, unit.master_numel, 2048)]
            with pytest.raises(KeyboardInterrupt):
                rewrite.run(spans, slots, fill)
            assert unit.home_stale
            torch.testing.assert_close(unit.master_copy(), master_before, rtol=0, atol=0)
            home_now = torch.empty(unit.numel, dtype=unit.compute_dtype)
            unit.home.read(home_now).wait()
            tail = slice(unit.master_numel, unit.numel)
            assert torch.equal(home_now[tail], home_before[tail])
            assert not torch.equal(home_now[:2048], home_before[:2048])  # written in place
            unit.fetch()  # rebuilds the head from the master
            assert not unit.home_stale
            assert torch.equal(unit.compute_flat.cpu(), home_before)
            unit.release()
        losses = train_llama(model, opt, data[1:])
        weights = {k: v.clone() for k, v in model.state_dict().items()}
        hetstore.release(model)
        return losses, weights

    clean, broken = run(False), run(True)
    assert broken[0] == clean[0]
    for name, value in broken[1].items():
        assert torch.equal(value, clean[1][name]), name


@pytest.mark.parametrize("param", ["none", "disk"])
def test_load_state_dict_reaches_frozen_parameters_without_a_master(tmp_path, param):
    """torch's own ``load_state_dict`` writes the frozen base too (into its home: it has
    no master), and ``state_dict`` gives it back exactly."""
    source = bf16_lora()
    with torch.no_grad():
        for p in source.parameters():
            p.mul_(2.0)  # exact in bf16: differs from the fresh model everywhere
    wanted = source.state_dict()
    model = bf16_lora()
    cfg = config(param, compute_dtype="bf16", offload_path=str(tmp_path))
    model, _ = hetstore.offload(model, trainable_adamw(model), cfg)
    assert any(u.has_home_only for u in hetstore.state_of(model).runtime.units)
    model.load_state_dict(wanted)
    got = model.state_dict()
    for name, value in wanted.items():
        assert torch.equal(got[name].to(value.dtype), value), name
    # and computes with it: as the source offloaded the same way (the same bf16 arithmetic)
    source, _ = hetstore.offload(
        source, trainable_adamw(source), config("cpu", compute_dtype="bf16")
    )
    ids = llama_batches(1)[0]
    assert model(input_ids=ids, labels=ids).loss == source(input_ids=ids, labels=ids).loss


def test_printing_an_offloaded_parameter_prints_its_value():
    """A released parameter has no bytes; torch's repr would read them (it crashed the
    interpreter). It prints its value, served from home (runtime/released.py), as a
    fetched one does."""
    model = FrozenNormGPT()
    model, _ = hetstore.offload(model, trainable_adamw(model), config("cpu"))
    value = model.state_dict()["blocks.0.ln1.weight"]
    wanted = repr(torch.nn.Parameter(value, requires_grad=False))  # frozen
    assert repr(model.blocks[0].ln1.weight) == wanted
    unit = hetstore.state_of(model).runtime.block_units[0]
    unit.fetch()
    assert repr(model.blocks[0].ln1.weight) == wanted
    unit.release()
