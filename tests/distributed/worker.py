"""One rank of the multi-process tests (tests/integration/test_distributed.py), run by torchrun or
by tests/distributed/launch.py. Writes what it measured to ``<out>/<scenario>-rank<r>.pt``;
the test process compares.

Scenarios (``--scenario``): each trains the tests' GPT for a few steps with per-rank
batch ``b``, gradient accumulation and clipping, three ways:

- hetstore sharded over the ranks (the default process group);
- PyTorch DDP over the same ranks (the reference of data-parallel semantics);
- on rank 0 only: plain PyTorch, and hetstore with ``process_group=False``, both on the
  combined batch ``world_size * b`` (what N ranks must equal; the second also gives the
  single-process memory figures).

``--fail die|hang``: rank 1 dies (``os._exit``) or hangs before the second step; rank 0
records the error it gets.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import gc
import os
import shutil
import sys
import time

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import hetstore  # noqa: E402
from tests.models.gpt import GPT, batches  # noqa: E402

PER_RANK_BATCH = 2
STEPS = 3
ACCUMULATE = 2
CLIP = 0.05  # small enough that every step clips (tests the all-reduced norm)


def scenario_config(name: str, path: str, **kwargs) -> hetstore.OffloadConfig:
    placements = {
        "cpu": ("cpu", "cpu"),
        "disk": ("disk", "disk"),
        "none": ("none", "none"),
        "mixed": ("cpu", "disk"),
    }
    param, optim = placements[name]
    return hetstore.OffloadConfig(
        offload_param=param,
        offload_optimizer=optim,
        offload_path=path,
        enable_pinned_mem=False,
        device="cpu",
        optimizer_chunk_size="64KB",  # several chunks per unit on disk
        **kwargs,
    )


def stepped_ahead(name: str, path: str, mine, result: dict) -> None:
    """Units stepped away from ``optimizer.step()``, sharded. On disk (``overlap_step=True``):
    each rank steps its own shard into disk shadows during backward, with the clip that
    bites every step (the rollback path, then the steps in the next forward) and with
    one that never bites (the commit path), each against the same without the overlap;
    then the overlap trial, then ``step_in_backward``. In host memory, never into
    shadows: the steps in the next forward, and ``step_in_backward``. The test compares
    bitwise."""
    if name == "cpu":
        in_next_forward(path, mine, result)
        in_backward(name, path, mine, result)
        return
    runs = [
        ("ahead", CLIP, True),
        ("ahead_unclipped", 1e9, True),
        ("unclipped", 1e9, False),
        ("clipped", CLIP, False),
    ]
    for key, clip, overlap in runs:
        model = make_model()
        model, optimizer = hetstore.offload(
            model, adamw(model.parameters()), scenario_config(name, path, overlap_step=overlap)
        )
        losses, norms = train(model, optimizer, mine, clip=clip, world_mean=True)
        result[f"{key}_losses"], result[f"{key}_norms"] = losses, norms
        result[f"{key}_weights"] = weights(model)
        result[f"{key}_speculation"] = optimizer.speculation_stats
        hetstore.release(model)
    overlap_trial(path, mine, result)
    in_backward(name, path, mine, result)


def overlap_trial(path: str, mine, result: dict) -> None:
    """``overlap_step='auto'`` on disk, sharded, its overlap trial made to run every step
    on a clock that differs per rank: rank 0 finds steps without overlap faster, rank 1
    slower by more. Every rank keeps the way their sums say (the ways each step took, in
    ``trial_ways``); the test compares them and, bitwise, with the run without overlap
    (a clip that bites: the overlap's steps run in the next forward)."""
    rank = dist.get_rank()
    for key, overlap in (("trial", "auto"), ("trial_reference", False)):
        model = make_model()
        model, optimizer = hetstore.offload(
            model, adamw(model.parameters()), scenario_config("disk", path, overlap_step=overlap)
        )
        ways: list[bool] = []
        after_step = None
        if overlap == "auto":
            policy = optimizer.step_ahead.policy
            trial = optimizer.overlap_trial
            costs = {True: 1.0, False: 0.5 if rank == 0 else 2.0}
            now = [0.0]

            def clock(trial=trial, costs=costs, now=now):
                now[0] += costs[trial.overlapping]  # (the way of the step that ended)
                return now[0]

            trial.clock, trial.after, trial.steps, trial.every = clock, 1, 1, 1

            def after_step(policy=policy, ways=ways):
                ways.append(policy.overlapping)  # (this step's: taken at its backward)

        losses, _ = train(
            model, optimizer, mine + mine, clip=CLIP, world_mean=True, after_step=after_step
        )
        result[f"{key}_losses"], result[f"{key}_weights"] = losses, weights(model)
        result[f"{key}_ways"] = ways
        hetstore.release(model)


def in_next_forward(path: str, mine, result: dict) -> None:
    """Host units' ordinary steps run in place in the next forward (``step_in_forward=True``,
    as on a GPU: the config's rule made to apply on this CPU device), sharded: each rank
    steps its own shard, landed before the unit's fetch gathers the shards. The test
    compares bitwise with the sharded run that steps in ``optimizer.step()``."""
    as_on_a_gpu = hetstore.OffloadConfig.steps_memory_in_forward
    hetstore.OffloadConfig.steps_memory_in_forward = lambda self, device=None: (
        self.step_in_forward is True
    )
    try:
        model = make_model()
        model, optimizer = hetstore.offload(
            model,
            adamw(model.parameters()),
            scenario_config("cpu", path, overlap_step=False, step_in_forward=True),
        )
    finally:
        hetstore.OffloadConfig.steps_memory_in_forward = as_on_a_gpu
    losses, norms = train(model, optimizer, mine, clip=CLIP, world_mean=True)
    result["in_forward_losses"], result["in_forward_norms"] = losses, norms
    result["in_forward_weights"] = weights(model)  # (reading them lands the last steps)
    result["in_forward_speculation"] = optimizer.speculation_stats
    hetstore.release(model)


def in_backward(name: str, path: str, mine, result: dict) -> None:
    """``step_in_backward=True``, sharded: each rank steps its own shard of a unit as
    soon as the unit's gradients are reduce-scattered. In host memory in place on its
    worker, landed before the unit's next fetch gathers the shards; on disk into
    shadows, from the gradient shard in memory (never written to disk), committed once
    backward has released the unit. No clip (which it refuses), the micro-batches before
    the last under ``hetstore.no_sync``; against the same loop with the step in
    ``optimizer.step()``, bitwise."""
    for key, consume in (("in_backward", True), ("after_backward", False)):
        model = make_model()
        model, optimizer = hetstore.offload(
            model,
            adamw(model.parameters()),
            scenario_config(name, path, overlap_step=False, step_in_backward=consume),
        )
        losses = []
        for i, (x, y) in enumerate(mine):
            last = (i + 1) % ACCUMULATE == 0
            with hetstore.no_sync(model) if not last else contextlib.nullcontext():
                loss = model(x, y) / ACCUMULATE
                loss.backward()
            losses.append(float(loss))
            if last:
                optimizer.step()
                optimizer.zero_grad()
        result[f"{key}_losses"] = losses
        result[f"{key}_weights"] = weights(model)
        result[f"{key}_speculation"] = optimizer.speculation_stats
        hetstore.release(model)


def make_model() -> GPT:
    torch.manual_seed(0)
    return GPT(vocab=64, width=48, depth=3, heads=4, ctx=16)


def adamw(params):
    return torch.optim.AdamW(params, lr=3e-3, weight_decay=0.1, fused=True)


def data(world: int):
    """Micro-batches of the combined batch; rank r trains rows [r*b, (r+1)*b)."""
    return batches(STEPS * ACCUMULATE, batch=PER_RANK_BATCH * world, seed=1)


def train(model, optimizer, micro_batches, *, clip, world_mean, after_step=None):
    """The tests' loop; losses are the combined batch's (mean over ranks when sharded).
    ``after_step``: called after each optimizer step (an evict/restore cycle)."""
    losses, norms = [], []
    for i, (x, y) in enumerate(micro_batches):
        loss = model(x, y) / ACCUMULATE
        loss.backward()
        value = loss.detach().clone()
        if world_mean:
            dist.all_reduce(value)
            value /= dist.get_world_size()
        losses.append(float(value))
        if (i + 1) % ACCUMULATE:
            continue
        if hasattr(optimizer, "clip_grad_norm_"):
            norms.append(float(optimizer.clip_grad_norm_(clip)))
        else:
            norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), clip)))
        optimizer.step()
        optimizer.zero_grad()
        if after_step is not None:
            after_step()
    return losses, norms


def weights(model) -> dict:
    """A copy of the state dict (a state dict shares storage with the model, as torch's)."""
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def rank_slice(micro_batches, rank):
    b = PER_RANK_BATCH
    return [(x[rank * b : (rank + 1) * b], y[rank * b : (rank + 1) * b]) for x, y in micro_batches]


def evicted(name: str, path: str, mine, result: dict) -> None:
    """The sharded run again with an evict/restore cycle after every step: each rank
    evicts its own shards (no collective), and restores them before the next forward."""
    model = make_model()
    model, optimizer = hetstore.offload(
        model, adamw(model.parameters()), scenario_config(name, path)
    )
    after_evict, moved = [], []

    def cycle() -> None:
        moved.append(hetstore.evict(model, optimizer).total)
        after_evict.append(hetstore.memory_stats(model)["device"]["current"])
        hetstore.restore(model, optimizer)

    result["evicted_losses"], _ = train(
        model, optimizer, mine, clip=CLIP, world_mean=True, after_step=cycle
    )
    result["evicted_weights"] = weights(model)
    result["evicted_device_after"] = after_evict
    result["evicted_bytes"] = moved
    hetstore.release(model)


def run_scenario(name: str, out: str, path: str) -> None:
    rank, world = dist.get_rank(), dist.get_world_size()
    full = data(world)
    mine = rank_slice(full, rank)
    result: dict = {}

    # hetstore, sharded over the ranks
    model = make_model()
    model, optimizer = hetstore.offload(
        model, adamw(model.parameters()), scenario_config(name, path)
    )
    start = time.perf_counter()
    losses, norms = train(model, optimizer, mine, clip=CLIP, world_mean=True)
    result["sharded_seconds"] = time.perf_counter() - start
    result["sharded_losses"], result["sharded_norms"] = losses, norms
    # (the weights first, as in the one-process run below: reading them lands the steps
    # still running on into the next forward, and the worker's chunk buffers go)
    result["sharded_weights"] = weights(model)  # a collective: full weights on every rank
    # (a collective too: every rank iterates, each gets the whole weights)
    result["named_weights"] = dict(hetstore.named_weights(model, torch.float32))
    result["sharded_stats"] = hetstore.memory_stats(model)
    disk = hetstore.state_of(model).tiers.disk_if_created
    result["disk_dir"] = disk.path if disk is not None else ""
    if name in ("cpu", "disk"):
        stepped_ahead(name, path, mine, result)
    hetstore.release(model)
    evicted(name, path, mine, result)

    # DDP, the data-parallel reference
    ddp_model = make_model()
    ddp = DistributedDataParallel(ddp_model)
    losses, norms = train(ddp, adamw(ddp.parameters()), mine, clip=CLIP, world_mean=True)
    result["ddp_losses"], result["ddp_norms"] = losses, norms
    result["ddp_weights"] = weights(ddp_model)

    if rank == 0:  # one process, the combined batch
        plain = make_model()
        losses, norms = train(plain, adamw(plain.parameters()), full, clip=CLIP, world_mean=False)
        result["plain_losses"], result["plain_norms"] = losses, norms
        result["plain_weights"] = weights(plain)
        single = make_model()
        single, single_opt = hetstore.offload(
            single, adamw(single.parameters()), scenario_config(name, path), process_group=False
        )
        losses, norms = train(single, single_opt, full, clip=CLIP, world_mean=False)
        result["single_losses"], result["single_norms"] = losses, norms
        # (the weights first: reading them lands the steps still running on into the
        # next forward, step_in_forward, whose buffers the sharded run never holds)
        result["single_weights"] = weights(single)
        result["single_stats"] = hetstore.memory_stats(single)
    dist.barrier()
    torch.save(result, os.path.join(out, f"{name}-rank{rank}.pt"))


def run_unfreeze(out: str, path: str) -> None:
    """Progressive unfreezing, sharded on host memory and on disk: the first two blocks
    frozen for steps 0-1 (after offload(), which laid them out trainable), trained for
    2-3, frozen again from 4; against plain PyTorch on rank 0 with the combined batch."""
    rank, world = dist.get_rank(), dist.get_world_size()
    full = batches(6, batch=PER_RANK_BATCH * world, seed=2)
    result: dict = {}

    def run(model, optimizer, micro_batches, world_mean):
        losses = []
        for step, (x, y) in enumerate(micro_batches):
            for block in model.blocks[:2]:
                block.requires_grad_(2 <= step < 4)
            loss = model(x, y)
            loss.backward()
            value = loss.detach().clone()
            if world_mean:
                dist.all_reduce(value)
                value /= world
            losses.append(float(value))
            optimizer.step()
            optimizer.zero_grad()
        return losses

    def sgd(params, fused=True):
        # (not Adam: its m/sqrt(v) turns the ranks' rounding of a gradient that is zero
        # in exact arithmetic, the attention's key bias, into up to lr*1e-2 of weight,
        # frozen or not; weight decay still moves a frozen parameter stepped wrongly.
        # Plain PyTorch's fused SGD fails once some momentum buffers exist and others do
        # not, which unfreezing makes: the reference takes the for-loop kernel)
        return torch.optim.SGD(
            params, lr=0.05, momentum=0.9, weight_decay=0.1, fused=fused, foreach=False
        )

    for name in ("cpu", "disk"):
        model = make_model()
        model, optimizer = hetstore.offload(
            model, sgd(model.parameters()), scenario_config(name, path)
        )
        result[f"{name}_losses"] = run(model, optimizer, rank_slice(full, rank), True)
        result[f"{name}_weights"] = weights(model)
        hetstore.release(model)
    if rank == 0:
        plain = make_model()
        result["plain_losses"] = run(plain, sgd(plain.parameters(), fused=False), full, False)
        result["plain_weights"] = weights(plain)
        result["initial_weights"] = weights(make_model())
    dist.barrier()
    torch.save(result, os.path.join(out, f"unfreeze-rank{rank}.pt"))


def run_failure(kind: str, out: str, path: str) -> None:
    rank = dist.get_rank()
    world = dist.get_world_size()
    model = make_model()
    model, optimizer = hetstore.offload(
        model, adamw(model.parameters()), scenario_config("cpu", path)
    )
    micro = rank_slice(data(world), rank)
    x, y = micro[0]
    model(x, y).backward()
    optimizer.step()
    optimizer.zero_grad()
    if rank == 1:
        if kind == "die":
            os._exit(3)
        time.sleep(600)  # hang; the test kills us
    start = time.perf_counter()
    try:
        model(x, y).backward()
        optimizer.step()
        message = "no error"
    except hetstore.HetstoreError as exc:
        message = f"{type(exc).__name__}: {exc}"
    with open(os.path.join(out, f"fail-{kind}.txt"), "w") as f:
        f.write(f"{time.perf_counter() - start:.2f}\n{message}\n")
    os._exit(0)  # the process group cannot be destroyed cleanly with a dead peer


def run_refusals(out: str, path: str) -> None:
    """What sharding refuses, each with its error (collected on every rank)."""
    found = {}
    model = make_model()
    rmsprop = torch.optim.RMSprop(model.parameters(), lr=1e-3)
    try:
        hetstore.offload(model, rmsprop, scenario_config("cpu", path))
        found["rmsprop"] = "no error"
    except hetstore.ConfigError as exc:
        found["rmsprop"] = str(exc)
    try:
        hetstore.offload(make_model(), None, scenario_config("cpu", path), process_group="all")
        found["bad_group"] = "no error"
    except hetstore.ConfigError as exc:
        found["bad_group"] = str(exc)
    model = make_model()
    model, optimizer = hetstore.offload(
        model, adamw(model.parameters()), scenario_config("cpu", path)
    )
    try:
        optimizer.state_dict()
        found["optimizer_state_dict"] = "no error"
    except RuntimeError as exc:
        found["optimizer_state_dict"] = str(exc)
    try:  # a read of a sharded parameter between uses would need a collective
        model.blocks[0].fc.weight.detach().clone()
        found["sharded_read"] = "no error"
    except hetstore.OffloadedParameterError as exc:
        found["sharded_read"] = str(exc)
    torch.save(found, os.path.join(out, f"refusals-rank{dist.get_rank()}.pt"))


def run_checkpoint(out: str, path: str) -> None:
    """Saved with 2 ranks, loaded with 2 (another placement) and with 1; saved with 1,
    loaded with 2. One step (two micro-batches) before each save, two after."""
    rank, world = dist.get_rank(), dist.get_world_size()
    full = data(world)
    mine = rank_slice(full, rank)
    two, one = os.path.join(out, "ckpt-2ranks"), os.path.join(out, "ckpt-1rank")
    result: dict = {}

    def offloaded(name: str, **kwargs):
        model = make_model()
        return hetstore.offload(
            model, adamw(model.parameters()), scenario_config(name, path), **kwargs
        )

    model, optimizer = offloaded("disk")
    train(model, optimizer, mine[:2], clip=CLIP, world_mean=True)
    hetstore.save(two, model, optimizer, extra={"step": 1})
    result["saved"] = weights(model)
    result["continued"] = train(model, optimizer, mine[2:], clip=CLIP, world_mean=True)
    result["continued_weights"] = weights(model)

    model, optimizer = offloaded("cpu")
    result["extra"] = hetstore.load(two, model, optimizer)
    result["loaded"] = weights(model)
    result["resumed"] = train(model, optimizer, mine[2:], clip=CLIP, world_mean=True)
    result["resumed_weights"] = weights(model)

    if rank == 0:
        model, optimizer = offloaded("none", process_group=False)
        hetstore.load(two, model, optimizer)
        result["one_loaded"] = weights(model)
        hetstore.save(os.path.join(out, "ckpt-resaved"), model, optimizer)
        result["one_resumed"] = train(model, optimizer, full[2:], clip=CLIP, world_mean=False)
        result["one_resumed_weights"] = weights(model)

        model, optimizer = offloaded("disk", process_group=False)
        train(model, optimizer, full[:2], clip=CLIP, world_mean=False)
        hetstore.save(one, model, optimizer)
        result["one_saved"] = weights(model)
        result["one_continued"] = train(model, optimizer, full[2:], clip=CLIP, world_mean=False)
        result["one_continued_weights"] = weights(model)
    dist.barrier()

    model, optimizer = offloaded("mixed")
    hetstore.load(one, model, optimizer)
    result["from_one_loaded"] = weights(model)
    result["from_one_resumed"] = train(model, optimizer, mine[2:], clip=CLIP, world_mean=True)
    result["from_one_resumed_weights"] = weights(model)

    # A checkpoint only rank 1 refuses (its own copy, one byte of LATEST changed): every
    # rank must refuse at once, before any changes its model. Without agreeing, rank 0
    # would wait in the load's collectives until the process group's timeout.
    copy = os.path.join(out, f"ckpt-copy-rank{rank}")
    shutil.copytree(two, copy)
    if rank == 1:
        with open(os.path.join(copy, "LATEST"), "r+b") as f:
            line = f.read()
            f.seek(len(line) - 2)  # the last hex digit of the index's CRC-32
            f.write(b"0" if line[-2:-1] != b"0" else b"1")
    before = weights(model)
    start = time.monotonic()
    try:
        hetstore.load(copy, model, optimizer)
        result["split_verify"] = "loaded"
    except Exception as exc:  # noqa: BLE001 - the test checks the type and message
        result["split_verify"] = f"{type(exc).__name__}: {exc}"
    result["split_verify_s"] = time.monotonic() - start
    result["split_verify_unchanged"] = all(
        torch.equal(value, before[key]) for key, value in weights(model).items()
    )
    torch.save(result, os.path.join(out, f"checkpoint-rank{rank}.pt"))


def run_compact(out: str, path: str) -> None:
    """Compact optimizer states (bf16, 8-bit) sharded over the ranks, on host memory and
    on disk, against one process with the same format and the combined batch; and a
    sharded checkpoint of them resumed."""
    rank, world = dist.get_rank(), dist.get_world_size()
    full = data(world)
    mine = rank_slice(full, rank)
    result: dict = {}
    for fmt in ("bf16", "8bit"):
        for name in ("cpu", "disk"):
            model = make_model()
            model, optimizer = hetstore.offload(
                model,
                adamw(model.parameters()),
                scenario_config(name, path, optimizer_state_format=fmt),
            )
            losses, norms = train(model, optimizer, mine, clip=CLIP, world_mean=True)
            result[f"{fmt}_{name}_losses"], result[f"{fmt}_{name}_norms"] = losses, norms
            result[f"{fmt}_{name}_weights"] = weights(model)
            result[f"{fmt}_{name}_state_dtypes"] = sorted(
                {str(a.dtype) for s in optimizer.unit_steps for a in s.states.values()}
            )
            # a sharded checkpoint of compact states, resumed: one more step each way
            ckpt = os.path.join(out, f"compact-{fmt}-{name}-ckpt")
            hetstore.save(ckpt, model, optimizer)
            key = f"{fmt}_{name}"
            result[f"{key}_continued_losses"], _ = train(
                model, optimizer, mine[:ACCUMULATE], clip=CLIP, world_mean=True
            )
            result[f"{key}_continued"] = weights(model)
            hetstore.release(model)
            resumed = make_model()
            resumed, resumed_opt = hetstore.offload(
                resumed,
                adamw(resumed.parameters()),
                scenario_config(name, path, optimizer_state_format=fmt),
            )
            hetstore.load(ckpt, resumed, resumed_opt)
            result[f"{key}_resumed_losses"], _ = train(
                resumed, resumed_opt, mine[:ACCUMULATE], clip=CLIP, world_mean=True
            )
            result[f"{key}_resumed"] = weights(resumed)
            hetstore.release(resumed)
        if rank == 0:
            single = make_model()
            single, single_opt = hetstore.offload(
                single,
                adamw(single.parameters()),
                scenario_config("cpu", path, optimizer_state_format=fmt),
                process_group=False,
            )
            losses, norms = train(single, single_opt, full, clip=CLIP, world_mean=False)
            result[f"{fmt}_single_losses"], result[f"{fmt}_single_norms"] = losses, norms
            result[f"{fmt}_single_weights"] = weights(single)
            hetstore.release(single)
    dist.barrier()
    torch.save(result, os.path.join(out, f"compact-rank{rank}.pt"))


def run_trial_ranks(out: str, path: str) -> None:
    """``overlap_step='auto'`` on disk where rank 1's shards hold nothing trainable (frozen
    weights, trained biases: a unit's trainable elements are laid out first, so they fall
    to rank 0), so rank 1 steps nothing ahead. The overlap trial (made to run every step
    here) still ends each step and votes on both ranks: training must neither hang nor
    differ from no overlap."""
    rank = dist.get_rank()
    result: dict = {}
    x = torch.randn(4, 64, generator=torch.Generator().manual_seed(rank))
    for key, overlap in (("auto", "auto"), ("off", False)):
        torch.manual_seed(0)
        blocks = torch.nn.Sequential(*[torch.nn.Linear(64, 64) for _ in range(3)])
        for block in blocks:
            block.weight.requires_grad_(False)
        trained = [p for p in blocks.parameters() if p.requires_grad]
        config = scenario_config("disk", path, overlap_step=overlap)
        model, optimizer = hetstore.offload(blocks, adamw(trained), config, units=list(blocks))
        if overlap == "auto":
            trial = optimizer.overlap_trial
            trial.after, trial.steps, trial.every = 1, 1, 1
            result["has_step_ahead"] = optimizer.step_ahead is not None
        losses = []
        for _ in range(8):
            loss = model(x).square().mean()
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            losses.append(float(loss))
        result[f"{key}_losses"], result[f"{key}_weights"] = losses, weights(model)
        if overlap == "auto":
            result["trials"] = optimizer.overlap_trial.trials
        hetstore.release(model)
    dist.barrier()
    torch.save(result, os.path.join(out, f"trial_ranks-rank{rank}.pt"))


def lora_shaped(model: GPT, base_dtype: torch.dtype = torch.bfloat16) -> tuple[GPT, list]:
    """Two linears of each block (fc, proj) as a frozen base outside the optimizer (as
    PEFT leaves a LoRA base), its values rounded to bf16 and kept in ``base_dtype``; the
    rest trained in fp32. Returns the model and its trained parameters."""
    for block in model.blocks:
        for linear in (block.fc, block.proj):
            linear.to(torch.bfloat16).to(base_dtype).requires_grad_(False)
    return model, [p for p in model.parameters() if p.requires_grad]


def run_frozen_base(out: str, path: str) -> None:
    """A frozen bf16 base sharded over the ranks has no fp32 master: each rank keeps its
    shard of it in bf16 only (as one process does). Trained with bf16 compute on host
    memory and on disk, against the same base kept in fp32 (whose master each rank
    holds, with the same values), then checkpointed and loaded back sharded."""
    rank = dist.get_rank()
    mine = rank_slice(data(dist.get_world_size()), rank)
    result: dict = {}
    for placement in ("cpu", "disk"):
        config = scenario_config(placement, path, compute_dtype="bf16")
        for kind, dtype in (("bf16", torch.bfloat16), ("fp32", torch.float32)):
            model, trained = lora_shaped(make_model(), dtype)
            if kind == "bf16":
                result[f"{placement}_base"] = {
                    k: v.clone() for k, v in model.state_dict().items() if v.dtype == dtype
                }
            model, optimizer = hetstore.offload(model, adamw(trained), config)
            units = hetstore.state_of(model).runtime.units
            key = f"{placement}_{kind}"
            result[f"{key}_master_numel"] = [u.master_numel for u in units]
            result[f"{key}_numel"] = [u.numel for u in units]
            result[f"{key}_losses"], _ = train(model, optimizer, mine, clip=CLIP, world_mean=True)
            result[f"{key}_weights"] = weights(model)
            if kind == "bf16":
                ckpt = os.path.join(out, f"frozen-{placement}-ckpt")
                hetstore.save(ckpt, model, optimizer)
                hetstore.release(model)
                again, trained = lora_shaped(make_model(), dtype)
                again, again_opt = hetstore.offload(again, adamw(trained), config)
                hetstore.load(ckpt, again, again_opt)
                result[f"{placement}_loaded"] = weights(again)
                hetstore.release(again)
            else:
                hetstore.release(model)
    dist.barrier()
    torch.save(result, os.path.join(out, f"frozen-rank{rank}.pt"))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--offload-path", required=True)
    parser.add_argument("--scenario", action="append", default=[])
    parser.add_argument("--fail", choices=("die", "hang"))
    parser.add_argument("--refusals", action="store_true")
    parser.add_argument("--checkpoint", action="store_true")
    parser.add_argument("--unfreeze", action="store_true")
    parser.add_argument("--compact", action="store_true")
    parser.add_argument("--frozen-base", action="store_true")
    parser.add_argument("--trial-ranks", action="store_true")
    parser.add_argument("--timeout", type=float, default=60.0)
    args = parser.parse_args()
    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=args.timeout))
    if args.fail:
        run_failure(args.fail, args.out, args.offload_path)
    if args.refusals:
        run_refusals(args.out, args.offload_path)
    if args.checkpoint:
        run_checkpoint(args.out, args.offload_path)
    if args.unfreeze:
        run_unfreeze(args.out, args.offload_path)
    if args.compact:
        run_compact(args.out, args.offload_path)
    if args.frozen_base:
        run_frozen_base(args.out, args.offload_path)
    if args.trial_ranks:
        run_trial_ranks(args.out, args.offload_path)
    for name in args.scenario:
        run_scenario(name, args.out, args.offload_path)
    # the scenarios' models are unreferenced now; collecting them frees their tiers and
    # their hold on the process group before it is destroyed (hetstore.lifetime)
    gc.collect()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
