"""hetstore.save / hetstore.load: resume is bitwise, across placements, plain PyTorch
included; bad checkpoints are refused before anything changes.

Tolerance: none. A resumed run repeats exactly the arithmetic of the run that went on
(same fused kernel on the same fp32 values, same data, same RNG), so losses and weights
are compared with ``==`` (``torch.equal``). Every placement runs the same element-wise
AdamW on the same fp32 masters, so a placement change is bitwise too.
"""

from __future__ import annotations

import signal
import subprocess
import sys
import textwrap

import pytest
import torch

import hetstore
from hetstore import CheckpointError, ConfigError, OffloadConfig
from tests.models.gpt import GPT

VOCAB, CTX = 64, 16
K, M = 3, 3  # steps before the save, steps after


def model_factory():
    return GPT(vocab=VOCAB, width=32, depth=2, heads=2, ctx=CTX)


def make_config(tmp_path, placement: str, **kwargs) -> OffloadConfig | None:
    if placement == "plain":
        return None
    if placement == "auto":
        return OffloadConfig(
            auto_offload=True,
            offload_path=str(tmp_path / "swap"),
            max_device_memory="500KB",
            enable_pinned_mem=False,
            device="cpu",
            **kwargs,
        )
    return OffloadConfig(
        offload_param=placement,
        offload_optimizer=placement,
        offload_path=str(tmp_path / "swap"),
        enable_pinned_mem=False,
        device="cpu",
        optimizer_chunk_size="32KB",  # several chunks per unit: chunk seams are exercised
        **kwargs,
    )


def two_groups(model):
    decay = [p for p in model.parameters() if p.dim() >= 2]
    rest = [p for p in model.parameters() if p.dim() < 2]
    return torch.optim.AdamW(
        [{"params": decay, "weight_decay": 0.1}, {"params": rest, "weight_decay": 0.0}],
        lr=1e-2,
        fused=True,
    )


class Run:
    """A model, its optimizer and LR scheduler, offloaded as ``placement`` says."""

    def __init__(self, tmp_path, placement: str, seed: int = 0, **config):
        torch.manual_seed(seed)
        self.model = model_factory()
        optimizer = two_groups(self.model)
        cfg = make_config(tmp_path, placement, **config)
        if cfg is not None:
            example = torch.zeros(4, CTX, dtype=torch.long)
            self.model, optimizer = hetstore.offload(
                self.model,
                optimizer,
                cfg,
                **({"example_inputs": (example, example)} if cfg.auto_offload else {}),
            )
        self.optimizer = optimizer
        self.scheduler = torch.optim.lr_scheduler.OneCycleLR(optimizer, 1e-2, total_steps=20)

    def train(self, steps: int) -> list[float]:
        """Batches drawn from the global RNG, so restoring it matters."""
        losses = []
        for _ in range(steps):
            idx = torch.randint(0, VOCAB, (4, CTX + 1))
            loss = self.model(idx[:, :-1], idx[:, 1:])
            loss.backward()
            losses.append(loss.item())
            clip = getattr(self.optimizer, "clip_grad_norm_", None)
            if clip is not None:
                clip(1.0)
            else:
                torch.nn.utils.clip_grad_norm_(self.model.parameters(), 1.0)
            self.optimizer.step()
            self.optimizer.zero_grad()
            self.scheduler.step()
        return losses

    def save(self, path):
        extra = {"scheduler": self.scheduler.state_dict(), "rng": torch.get_rng_state()}
        return hetstore.save(path, self.model, self.optimizer, extra=extra)

    def load(self, path):
        extra = hetstore.load(path, self.model, self.optimizer)
        self.scheduler.load_state_dict(extra["scheduler"])
        torch.set_rng_state(extra["rng"])

    def weights(self) -> dict[str, torch.Tensor]:
        return {k: v.clone() for k, v in self.model.state_dict().items()}


def assert_bitwise(a: dict, b: dict):
    assert a.keys() == b.keys()
    for key in a:
        assert torch.equal(a[key], b[key]), f"{key}: max diff {(a[key] - b[key]).abs().max()}"


def continued_and_resumed(tmp_path, saved_as: str, loaded_as: str):
    first = Run(tmp_path / "a", saved_as)
    first.train(K)
    first.save(tmp_path / "ck")
    expected = first.train(M)
    second = Run(tmp_path / "b", loaded_as, seed=1)  # other initial weights: load must win
    second.load(tmp_path / "ck")
    got = second.train(M)
    return first, second, expected, got


@pytest.mark.parametrize("placement", ["none", "cpu", "disk"])
def test_resume_is_bitwise(tmp_path, placement):
    first, second, expected, got = continued_and_resumed(tmp_path, placement, placement)
    assert got == expected
    assert_bitwise(first.weights(), second.weights())
    assert first.optimizer.param_groups[0]["lr"] == second.optimizer.param_groups[0]["lr"]


@pytest.mark.parametrize(
    "saved_as, loaded_as",
    [("disk", "cpu"), ("disk", "none"), ("none", "disk"), ("cpu", "auto"), ("disk", "plain")],
)
def test_resume_across_a_placement_change_is_bitwise(tmp_path, saved_as, loaded_as):
    first, second, expected, got = continued_and_resumed(tmp_path, saved_as, loaded_as)
    assert got == expected
    assert_bitwise(first.weights(), second.weights())


def test_plain_pytorch_checkpoint_resumes_offloaded_to_disk(tmp_path):
    first, second, expected, got = continued_and_resumed(tmp_path, "plain", "disk")
    assert got == expected
    assert_bitwise(first.weights(), second.weights())


def test_unit_files_are_plain_safetensors_of_the_weights(tmp_path):
    from safetensors.torch import load_file

    run = Run(tmp_path, "disk")
    run.train(2)
    path = run.save(tmp_path / "ck")
    found = {}
    for file in sorted(path.glob("unit-*.safetensors")):
        found.update(load_file(file))
    names = [name for name, _ in run.model.named_parameters()]  # a tied parameter once
    weights = {name: value for name, value in run.weights().items() if name in names}
    for name, value in weights.items():
        assert torch.equal(found[name], value), name
    exp_avg = [k for k in found if k.endswith("/exp_avg")]
    assert len(exp_avg) == len(weights)  # every parameter has been stepped
    assert all(found[k].shape == weights[k.split("/")[0]].shape for k in exp_avg)


def test_a_checkpoint_before_the_first_step_gives_fresh_states(tmp_path):
    fresh = Run(tmp_path / "a", "disk")
    fresh.save(tmp_path / "ck")
    expected = fresh.train(M)
    used = Run(tmp_path / "b", "disk", seed=1)
    used.train(2)  # moments and step counters are not zero any more
    used.load(tmp_path / "ck")
    assert used.train(M) == expected
    assert_bitwise(fresh.weights(), used.weights())


@pytest.mark.parametrize("damage", ["flip", "truncate"])
def test_a_damaged_checkpoint_is_refused_naming_the_file_and_changes_nothing(tmp_path, damage):
    run = Run(tmp_path / "a", "disk")
    run.train(1)
    path = run.save(tmp_path / "ck")
    victim = sorted(path.glob("unit-*.safetensors"))[1]
    data = bytearray(victim.read_bytes())
    if damage == "flip":
        data[len(data) // 2] ^= 0x10
    else:
        del data[-100:]
    victim.write_bytes(bytes(data))
    other = Run(tmp_path / "b", "disk", seed=1)
    before = other.weights()
    with pytest.raises(CheckpointError, match=victim.name):
        other.load(tmp_path / "ck")
    assert_bitwise(before, other.weights())


def test_mismatches_are_refused_before_anything_changes(tmp_path):
    run = Run(tmp_path / "a", "cpu")
    run.train(1)
    run.save(tmp_path / "ck")

    torch.manual_seed(0)
    wider = GPT(vocab=VOCAB, width=48, depth=2, heads=2, ctx=CTX)
    with pytest.raises(
        ConfigError, match=r"another shape.*'wte\.weight': \[64, 32\] in the checkpoint, \[64, 48\]"
    ):
        hetstore.load(tmp_path / "ck", wider)

    torch.manual_seed(0)
    deeper = GPT(vocab=VOCAB, width=32, depth=3, heads=2, ctx=CTX)
    with pytest.raises(ConfigError, match=r"missing \['blocks\.2"):
        hetstore.load(tmp_path / "ck", deeper)

    other = Run(tmp_path / "b", "cpu", seed=1)
    sgd_model = model_factory()
    sgd = torch.optim.SGD(sgd_model.parameters(), lr=0.1)
    with pytest.raises(ConfigError, match="optimizer is AdamW, this one is SGD"):
        hetstore.load(tmp_path / "ck", sgd_model, sgd)
    one_group = torch.optim.AdamW(sgd_model.parameters())
    with pytest.raises(ConfigError, match="param groups"):
        hetstore.load(tmp_path / "ck", sgd_model, one_group)
    with pytest.raises(ConfigError, match="the optimizer hetstore.offload"):
        hetstore.load(tmp_path / "ck", other.model, two_groups(model_factory()))


def test_a_non_strict_load_keeps_what_the_checkpoint_lacks(tmp_path):
    run = Run(tmp_path / "a", "cpu")
    run.train(1)
    run.save(tmp_path / "ck")
    saved = run.weights()
    torch.manual_seed(1)
    deeper = GPT(vocab=VOCAB, width=32, depth=3, heads=2, ctx=CTX)
    deeper, _ = hetstore.offload(deeper, None, make_config(tmp_path / "b", "disk"))
    before = {k: v.clone() for k, v in deeper.state_dict().items()}
    hetstore.load(tmp_path / "ck", deeper, strict=False)
    after = deeper.state_dict()
    for key, value in after.items():
        expected = saved[key] if key in saved else before[key]
        assert torch.equal(value, expected), key
    assert any(k.startswith("blocks.2") for k in after)


def test_extra_that_cannot_be_stored_is_refused_before_writing(tmp_path):
    run = Run(tmp_path, "cpu")
    run.save(tmp_path / "ck")
    versions = sorted(p.name for p in (tmp_path / "ck").iterdir())
    with pytest.raises(TypeError, match=r"extra\['fn'\] is a builtins.function"):
        hetstore.save(tmp_path / "ck", run.model, run.optimizer, extra={"fn": lambda: 0})
    assert sorted(p.name for p in (tmp_path / "ck").iterdir()) == versions


def test_extra_round_trips_python_torch_and_numpy_values(tmp_path):
    import random

    import numpy as np

    run = Run(tmp_path, "cpu")
    extra = {
        "python_rng": random.getstate(),
        "numpy_rng": np.random.get_state(),
        "int_keys": {1: "a", 2: (3.5, float("inf"))},
        "half": torch.arange(4, dtype=torch.bfloat16),
        "none": None,
    }
    hetstore.save(tmp_path / "ck", run.model, extra=extra)
    got = hetstore.load(tmp_path / "ck", run.model)
    assert got["python_rng"] == extra["python_rng"]
    random.setstate(got["python_rng"])  # accepted as it was saved
    assert got["numpy_rng"][0] == "MT19937"
    assert np.array_equal(got["numpy_rng"][1], extra["numpy_rng"][1])
    assert got["int_keys"] == extra["int_keys"]
    assert torch.equal(got["half"], extra["half"]) and got["half"].dtype == torch.bfloat16
    assert got["none"] is None


# A training run that saves a second checkpoint and is SIGKILLed at its n-th fsync. A save
# of this model fsyncs 12 times: 3 unit files (1-3), buffers, optimizer, extra (4-7), the
# index (8), the version and parent directories (9, 10), the new LATEST (11), the parent
# after LATEST is replaced (12).
KILLED_SAVE = textwrap.dedent(
    """
    import os, signal, sys
    sys.path.insert(0, {root!r})
    from pathlib import Path
    from tests.checkpoint.test_checkpoint import Run
    tmp, kill_at = Path(sys.argv[1]), int(sys.argv[2])
    run = Run(tmp / "a", "disk")
    run.load(tmp / "ck")
    run.train(2)
    real_fsync, calls = os.fsync, [0]
    def fsync(fd):
        calls[0] += 1
        if calls[0] == kill_at:
            os.kill(os.getpid(), signal.SIGKILL)
        real_fsync(fd)
    os.fsync = fsync
    run.save(tmp / "ck")
    """
)


@pytest.mark.parametrize("kill_at", [1, 3, 5, 8, 10, 11, 12])
def test_sigkill_during_a_save_leaves_the_previous_checkpoint_resuming(tmp_path, kill_at):
    import pathlib

    first = Run(tmp_path / "a", "disk")
    first.train(K)
    first.save(tmp_path / "ck")
    expected = first.train(M)
    root = str(pathlib.Path(__file__).resolve().parents[2])
    script = KILLED_SAVE.format(root=root)
    done = subprocess.run([sys.executable, "-c", script, str(tmp_path), str(kill_at)], timeout=300)
    assert done.returncode == -signal.SIGKILL
    resumed = Run(tmp_path / "b", "cpu", seed=1)
    try:
        resumed.load(tmp_path / "ck")
    except CheckpointError:
        pytest.fail("the checkpoint after a killed save does not load")
    if resumed.scheduler.last_epoch == K:  # the previous checkpoint
        assert resumed.train(M) == expected
    else:  # killed after LATEST was replaced: the new one, complete
        assert resumed.scheduler.last_epoch == K + 2


# ---------------------------------------------------------------------- export_weights
def test_exported_weights_load_into_plain_pytorch_strictly(tmp_path):
    from safetensors.torch import load_file

    run = Run(tmp_path, "disk")
    run.train(2)
    files = hetstore.export_weights(tmp_path / "out", run.model)
    assert [f.name for f in files] == ["model.safetensors"]
    plain = model_factory()
    plain.load_state_dict(load_file(files[0]), strict=True)  # tied names included
    assert_bitwise(run.weights(), plain.state_dict())
    assert not list((tmp_path / "out").glob(".*tmp*"))  # no temporaries left


def test_export_in_bf16_and_in_shards(tmp_path):
    import json

    from safetensors.torch import load_file

    run = Run(tmp_path, "cpu")
    run.train(1)
    weights = run.weights()
    files = hetstore.export_weights(
        tmp_path / "out", run.model, dtype=torch.bfloat16, max_shard_size="20KB"
    )
    assert len(files) > 2 and files[-1].name == "model.safetensors.index.json"
    index = json.loads(files[-1].read_text())
    found = {}
    for shard in sorted(set(index["weight_map"].values())):
        found.update(load_file(tmp_path / "out" / shard))
    assert found.keys() == weights.keys() == index["weight_map"].keys()
    for key, value in weights.items():
        assert found[key].dtype == torch.bfloat16
        assert torch.equal(found[key], value.to(torch.bfloat16)), key
    # hetstore's own loader reads the sharded export back into an offloaded model
    torch.manual_seed(1)
    other, _ = hetstore.offload(model_factory(), None, make_config(tmp_path / "b", "disk"))
    hetstore.load_weights(other, tmp_path / "out")
    for key, value in other.state_dict().items():
        assert torch.equal(value, weights[key].to(torch.bfloat16).float()), key


def test_export_refuses_bad_arguments(tmp_path):
    run = Run(tmp_path, "cpu")
    with pytest.raises(ConfigError, match="dtype=torch.int8"):
        hetstore.export_weights(tmp_path / "out", run.model, dtype=torch.int8)
    with pytest.raises(ConfigError, match="max_shard_size='lots'"):
        hetstore.export_weights(tmp_path / "out", run.model, max_shard_size="lots")
    (tmp_path / "file").write_text("")
    with pytest.raises(ConfigError, match="not a directory"):
        hetstore.export_weights(tmp_path / "file", run.model)


def test_a_disk_that_fills_during_a_save_raises_and_keeps_the_previous_checkpoint(tmp_path):
    from tests import disk_helpers

    run = Run(tmp_path / "a", "disk")
    run.train(K)
    with disk_helpers.small_tmpfs(tmp_path, "600k") as mnt:  # a 350 KB version fits, two do not
        run.save(mnt / "ck")
        expected = run.train(M)
        with pytest.raises(
            OSError,
            match=r"unit-\d+\.safetensors' failed: No space left.*"
            "previous checkpoint .* is unchanged",
        ):
            run.save(mnt / "ck")
        assert sorted(p.name for p in (mnt / "ck").iterdir()) == ["LATEST", "v000001"]
        resumed = Run(tmp_path / "b", "cpu", seed=1)
        resumed.load(mnt / "ck")
        assert resumed.train(M) == expected


SGD = (torch.optim.SGD, dict(lr=0.05, momentum=0.9))  # momentum made at the first step
RMSPROP = (torch.optim.RMSprop, dict(lr=1e-3, momentum=0.5))  # stepped per parameter view


# (states on disk are streamed for Adam, AdamW and SGD only; others are refused there)
@pytest.mark.parametrize(
    "optimizer_class, kwargs, placement",
    [(*SGD, "cpu"), (*SGD, "disk"), (*RMSPROP, "cpu")],
    ids=["sgd-momentum-cpu", "sgd-momentum-disk", "rmsprop-cpu"],
)
def test_other_optimizers_resume_bitwise(tmp_path, optimizer_class, kwargs, placement):
    def build(seed, where):
        torch.manual_seed(seed)
        model = model_factory()
        optimizer = optimizer_class(model.parameters(), **kwargs)
        return hetstore.offload(model, optimizer, make_config(where, placement))

    def train(model, optimizer, steps):
        losses = []
        for _ in range(steps):
            idx = torch.randint(0, VOCAB, (4, CTX + 1))
            loss = model(idx[:, :-1], idx[:, 1:])
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            losses.append(loss.item())
        return losses

    model, optimizer = build(0, tmp_path / "a")
    train(model, optimizer, K)
    hetstore.save(tmp_path / "ck", model, optimizer, extra={"rng": torch.get_rng_state()})
    expected = train(model, optimizer, M)
    other, other_optimizer = build(1, tmp_path / "b")
    train(other, other_optimizer, 1)  # states exist and differ
    torch.set_rng_state(hetstore.load(tmp_path / "ck", other, other_optimizer)["rng"])
    assert train(other, other_optimizer, M) == expected
    assert_bitwise(
        {k: v.clone() for k, v in model.state_dict().items()},
        {k: v.clone() for k, v in other.state_dict().items()},
    )
