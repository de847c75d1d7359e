"""The libraries people fine-tune with, on an offloaded model: transformers' Trainer,
accelerate, PEFT, safetensors. Each is compared with the same library driving plain
PyTorch on the same seed (torch's fused AdamW). Tolerance TIGHT (fp32 round-off): the
gradients are autograd's, moved not recomputed, and the step is the same fused kernel
(measured equal)."""

from __future__ import annotations

import copy

import pytest
import torch

import hetstore
from hetstore import OffloadConfig
from tests.models.hf import build, llama
from tests.parity import TIGHT, assert_same_weights

transformers = pytest.importorskip("transformers")
accelerate = pytest.importorskip("accelerate")
peft = pytest.importorskip("peft")
safetensors_torch = pytest.importorskip("safetensors.torch")


def config(param="cpu", optimizer="cpu", grad="cpu"):
    # gradients in host memory unless asked: every torch gradient API works there; on
    # disk, p.grad serves clip_grad_norm_ and zero_grad only (optim.disk_grads)
    return OffloadConfig(
        offload_param=param,
        offload_optimizer=optimizer,
        offload_grad=grad,
        enable_pinned_mem=False,
        device="cpu",
    )


# where the model's parameters, states and gradients live: host memory, or disk (whose
# steps a clip that bites leaves to run on into the next forward, step_in_forward='auto')
PLACEMENTS = pytest.mark.parametrize(
    "where",
    [("cpu", "cpu"), ("disk", "disk"), ("disk", "disk", "disk")],
    ids=["host", "disk", "disk-grads"],
)


def tiny_llama():
    return build(llama())


def adamw(model, lr=1e-2):
    params = [p for p in model.parameters() if p.requires_grad]
    return torch.optim.AdamW(params, lr=lr, weight_decay=0.1, fused=True)


def dataset(n=8):
    g = torch.Generator().manual_seed(0)
    rows = []
    for _ in range(n):
        ids = torch.randint(0, 128, (16,), generator=g)
        rows.append({"input_ids": ids, "labels": ids.clone()})
    return rows


# ---------------------------------------------------------------------- Trainer
def run_trainer(model, optimizer, tmp_path, **args):
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0 / (1 + step))
    arguments = transformers.TrainingArguments(
        output_dir=str(tmp_path),
        per_device_train_batch_size=2,
        max_steps=3,
        logging_steps=1,
        report_to=[],
        save_strategy="no",
        use_cpu=True,
        seed=0,
        **args,
    )
    trainer = transformers.Trainer(
        model=model,
        args=arguments,
        train_dataset=dataset(),
        optimizers=(optimizer, scheduler),
    )
    trainer.train()
    logs = [entry for entry in trainer.state.log_history if "loss" in entry]
    return [e["loss"] for e in logs], [e.get("grad_norm") for e in logs]


@pytest.mark.parametrize(
    "args",
    [
        dict(max_grad_norm=0.0),  # no clipping
        dict(max_grad_norm=1.0, gradient_accumulation_steps=2),  # Trainer's default clip
    ],
    ids=["no-clip", "accumulate-2-clip-1"],
)
@PLACEMENTS
def test_trainer_trains_like_plain_trainer(args, where, tmp_path):
    ref = tiny_llama()
    mine = copy.deepcopy(ref)
    ref_losses, ref_norms = run_trainer(ref, adamw(ref), tmp_path / "ref", **args)
    mine, opt = hetstore.offload(mine, adamw(mine), config(*where))
    losses, norms = run_trainer(mine, opt, tmp_path / "mine", **args)
    torch.testing.assert_close(losses, ref_losses, **TIGHT)
    assert_same_weights(ref, mine)
    if args["max_grad_norm"]:
        assert all(n is not None and n > 1.0 for n in ref_norms), "clip must be active"
        assert norms == ref_norms  # the true grad norm is logged (it was 0.0)
    if where == ("disk", "disk"):  # every step but the last ran on into the next forward
        assert opt.speculation_stats["in_forward"] > 0


def test_trainer_with_overlap_step_on_host_units_trains_as_plain_trainer(tmp_path):
    """``overlap_step=True`` with host units under Trainer, which passes every gradient
    through torch's clip_grad_norm_ to log the norm: host units are never stepped in
    backward (on a GPU they step in the next forward), so nothing is taken ahead to
    roll back, and training is plain Trainer's."""
    ref = tiny_llama()
    mine = copy.deepcopy(ref)
    ref_losses, _ = run_trainer(ref, adamw(ref), tmp_path / "ref", max_grad_norm=0.0)
    base = config()
    cfg = OffloadConfig(
        **{**{k: getattr(base, k) for k in OffloadConfig.keys()}, "overlap_step": True}
    )
    mine, opt = hetstore.offload(mine, adamw(mine), cfg)
    losses, _ = run_trainer(mine, opt, tmp_path / "mine", max_grad_norm=0.0)
    torch.testing.assert_close(losses, ref_losses, **TIGHT)
    assert_same_weights(ref, mine)
    assert opt.speculation_stats is None  # (no step machinery on a CPU device)


# ---------------------------------------------------------------------- accelerate
def accelerate_steps(model, optimizer, rows, clip=0.5):
    accelerator = accelerate.Accelerator(cpu=True)
    model, optimizer = accelerator.prepare(model, optimizer)
    norms = []
    for row in rows:
        ids = row["input_ids"][None]
        loss = model(input_ids=ids, labels=ids).loss
        accelerator.backward(loss)
        norms.append(float(accelerator.clip_grad_norm_(model.parameters(), clip)))
        optimizer.step()
        optimizer.zero_grad()
    return accelerator, model, optimizer, norms


@PLACEMENTS
def test_accelerate_clip_and_save_state_load_state(where, tmp_path):
    ref = tiny_llama()
    mine = copy.deepcopy(ref)
    rows = dataset(6)
    _, ref, ref_opt, ref_norms = accelerate_steps(ref, adamw(ref), rows[:3])
    mine, opt = hetstore.offload(mine, adamw(mine), config(*where))
    acc, mine, opt, norms = accelerate_steps(mine, opt, rows[:3])
    assert all(n > 0.5 for n in ref_norms) and norms == ref_norms
    if where == ("disk", "disk"):  # the clip bit: the steps ran on into the next forward
        assert opt.optimizer.speculation_stats["in_forward"] > 0
    assert_same_weights(ref, mine)

    acc.save_state(str(tmp_path / "state"))
    saved = safetensors_torch.load_file(str(tmp_path / "state" / "model.safetensors"))
    assert saved.keys() == ref.state_dict().keys()  # nothing dropped as a "tie"

    # more steps, then load the saved state into a fresh offloaded model: it resumes
    _, ref, ref_opt, _ = accelerate_steps(ref, ref_opt, rows[3:])
    fresh = tiny_llama()
    torch.manual_seed(5)
    for p in fresh.parameters():  # different weights: the load must overwrite them
        torch.nn.init.normal_(p)
    fresh, fresh_opt = hetstore.offload(fresh, adamw(fresh), config(*where))
    acc2 = accelerate.Accelerator(cpu=True)
    fresh, fresh_opt = acc2.prepare(fresh, fresh_opt)
    acc2.load_state(str(tmp_path / "state"))
    _, fresh, _, _ = accelerate_steps(fresh, fresh_opt, rows[3:])
    assert_same_weights(ref, fresh)


# ---------------------------------------------------------------------- PEFT, safetensors
def test_peft_save_pretrained_writes_the_trained_adapter(tmp_path):
    lora_config = peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj"], lora_dropout=0.0)
    ref = peft.get_peft_model(tiny_llama(), lora_config)
    mine = copy.deepcopy(ref)
    mine, opt = hetstore.offload(mine, adamw(mine), config("disk"))
    ref_opt = adamw(ref)
    for model, optimizer in ((ref, ref_opt), (mine, opt)):
        for row in dataset(3):
            ids = row["input_ids"][None]
            model(input_ids=ids, labels=ids).loss.backward()
            optimizer.step()
            model.zero_grad()
    ref.save_pretrained(str(tmp_path / "ref"))
    mine.save_pretrained(str(tmp_path / "mine"))
    want = safetensors_torch.load_file(str(tmp_path / "ref" / "adapter_model.safetensors"))
    got = safetensors_torch.load_file(str(tmp_path / "mine" / "adapter_model.safetensors"))
    assert got.keys() == want.keys() and got
    for key in want:
        torch.testing.assert_close(got[key], want[key], **TIGHT, msg=key)


def test_safetensors_save_file_of_state_dict(tmp_path):
    model = tiny_llama()
    plain = copy.deepcopy(model)
    model, _ = hetstore.offload(model, adamw(model), config())
    state = model.state_dict()
    storages = {t.untyped_storage().data_ptr() for t in state.values()}
    assert len(storages) == len(state)  # no two entries share a storage (nothing is tied)
    safetensors_torch.save_file(state, str(tmp_path / "w.safetensors"))
    loaded = safetensors_torch.load_file(str(tmp_path / "w.safetensors"))
    plain.load_state_dict(loaded)
    assert_same_weights(plain, model)
