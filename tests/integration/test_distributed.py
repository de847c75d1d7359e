"""ZeRO-3 sharding over torch.distributed: 2 ranks (gloo, CPU) in real subprocesses.

One torchrun launch trains every scenario (tests/distributed/worker.py) and the tests
compare what each rank wrote:

- hetstore sharded over 2 ranks with per-rank batch b, against plain PyTorch on one
  process with batch 2b and against DDP: losses to 1e-6 relative, clip norms to 1e-6
  relative, weights to atol 1e-5. Why not bitwise: averaging two half-batch gradients
  (sum of two means, halved) rounds differently from one mean over the whole batch
  (~1e-7 relative per gradient element), and Adam's m/sqrt(v) turns such a difference
  in a near-zero gradient into up to ~lr*1e-3 of weight; DDP itself is 1.1e-6 from the
  single-process reference here. The sharded run and DDP differ from the reference by
  the same amount (measured 9.6e-7 and 1.1e-6).
- the same scenario with ``process_group=False`` on rank 0 (one process, hetstore, the
  combined batch) equals plain PyTorch bitwise, as the single-process tests show.
- each rank's host and disk use is about half the single-process figure.
"""

from __future__ import annotations

import pytest
import torch

from tests.distributed.launch import start_ranks, torchrun
from tests.distributed.worker import STEPS, make_model

SCENARIOS = ("cpu", "disk", "none", "mixed")
WEIGHTS = dict(rtol=1e-5, atol=1e-5)
CLOSE = dict(rtol=1e-6, atol=0.0)


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    out = tmp_path_factory.mktemp("ranks")
    offload_path = tmp_path_factory.mktemp("offload")
    args = ["--out", str(out), "--offload-path", str(offload_path), "--refusals", "--checkpoint"]
    args += ["--unfreeze", "--compact", "--frozen-base", "--trial-ranks"]
    for name in SCENARIOS:
        args += ["--scenario", name]
    done = torchrun(2, args, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]

    def load(name: str, rank: int) -> dict:
        if name == "dir":
            return out
        return torch.load(out / f"{name}-rank{rank}.pt", weights_only=True)

    return load


def assert_weights_close(mine: dict, ref: dict, **tol) -> None:
    assert mine.keys() == ref.keys()
    for key in ref:
        assert mine[key].shape == ref[key].shape, key
        torch.testing.assert_close(mine[key], ref[key], **tol, msg=key)


@pytest.mark.parametrize("scenario", SCENARIOS)
def test_two_ranks_train_like_one_process_with_the_combined_batch(results, scenario):
    rank0, rank1 = results(scenario, 0), results(scenario, 1)
    # the combined batch's losses (mean over ranks) and the all-reduced clip norms
    torch.testing.assert_close(rank0["sharded_losses"], rank0["plain_losses"], **CLOSE)
    torch.testing.assert_close(rank0["sharded_norms"], rank0["plain_norms"], **CLOSE)
    torch.testing.assert_close(rank0["sharded_losses"], rank0["ddp_losses"], **CLOSE)
    torch.testing.assert_close(rank0["sharded_norms"], rank0["ddp_norms"], **CLOSE)
    assert all(n > 0.05 for n in rank0["plain_norms"])  # every step was clipped
    # final weights: gathered by model.state_dict() on each rank
    assert_weights_close(rank0["sharded_weights"], rank0["plain_weights"], **WEIGHTS)
    assert_weights_close(rank0["sharded_weights"], rank0["ddp_weights"], **WEIGHTS)
    assert_weights_close(rank1["sharded_weights"], rank0["sharded_weights"], rtol=0, atol=0)
    # the training moved the weights far past the tolerance
    initial = make_model().state_dict()
    moved = max((rank0["plain_weights"][k] - initial[k]).abs().max() for k in initial)
    assert moved > 1e-3
    # hetstore in one process (process_group=False) is plain PyTorch, bitwise
    assert rank0["single_losses"] == rank0["plain_losses"]
    assert_weights_close(rank0["single_weights"], rank0["plain_weights"], rtol=0, atol=0)


@pytest.mark.parametrize("rank", [0, 1])
def test_two_ranks_step_their_host_shards_in_the_next_forward_exactly(results, rank):
    """``step_in_forward=True`` on host placement (as on a GPU), sharded: each rank's
    ordinary step of its shard runs in place during the next forward and lands before
    the unit's fetch gathers the shards. Bitwise the sharded run that steps in
    ``optimizer.step()``, clip biting every step."""
    got = results("cpu", rank)
    assert got["in_forward_losses"] == got["sharded_losses"]
    assert got["in_forward_norms"] == got["sharded_norms"]
    assert_same(got["in_forward_weights"], got["sharded_weights"])
    assert got["in_forward_speculation"]["in_forward"] > 0, got["in_forward_speculation"]


@pytest.mark.parametrize("rank", [0, 1])
@pytest.mark.parametrize("scenario", ["cpu", "disk"])
def test_two_ranks_step_their_shards_in_backward_exactly(results, scenario, rank):
    """``step_in_backward=True``, sharded: each rank steps its shard of a unit as soon as
    the unit's gradients are reduce-scattered; in host memory its ordinary step in place
    on the worker, on disk into shadows from the gradient shard in memory. Bitwise the
    sharded run that steps in ``optimizer.step()``."""
    got = results(scenario, rank)
    assert got["in_backward_losses"] == got["after_backward_losses"]
    assert_same(got["in_backward_weights"], got["after_backward_weights"])
    stats = got["in_backward_speculation"]
    # every unit, every step; in host memory not the root (stepped in optimizer.step())
    units = 3 if scenario == "cpu" else 4
    assert stats["committed"] == stats["started"] == units * STEPS, stats


@pytest.mark.parametrize("rank", [0, 1])
def test_two_ranks_step_their_disk_shards_ahead_exactly(results, rank):
    """``overlap_step=True`` with everything on disk, sharded: each rank steps its shard
    of a unit into disk shadows as soon as the unit's gradients are reduce-scattered
    (and, after a clip that bit, during the next forward: ``step_in_forward``).
    Bitwise the run without the overlap, on the commit path (a clip that never bites)
    and on the rollback path (one that bites every step)."""
    got = results("disk", rank)
    assert got["ahead_losses"] == got["clipped_losses"]
    assert got["ahead_norms"] == got["clipped_norms"]
    assert_same(got["ahead_weights"], got["clipped_weights"])
    rolled = got["ahead_speculation"]
    assert rolled["started"] > 0 and rolled["committed"] == 0, rolled  # the clip bit
    assert rolled["held_back"] > 0 and rolled["in_forward"] > 0, rolled
    assert got["ahead_unclipped_losses"] == got["unclipped_losses"]
    assert_same(got["ahead_unclipped_weights"], got["unclipped_weights"])
    committed = got["ahead_unclipped_speculation"]
    assert committed["started"] > 0, committed
    assert committed["committed"] == committed["started"] - committed["cancelled"], committed
    assert committed["rolled_back"] == 0, committed
    assert got["unclipped_speculation"] is None


@pytest.mark.parametrize("rank", [0, 1])
def test_two_ranks_keep_the_same_way_from_the_overlap_trial(results, rank):
    """``overlap_step='auto'``'s trial (optim.policy.OverlapTrial) decides on the step
    times summed over the ranks: with clocks that disagree, both ranks take the same
    way each step (rank 0 alone would drop overlap at step 5), and switching ways trains
    bitwise like no overlap."""
    got = results("disk", rank)
    assert got["trial_ways"] == [True, True, False, False, True, False]
    assert got["trial_losses"] == got["trial_reference_losses"]
    assert_same(got["trial_weights"], got["trial_reference_weights"])


def test_the_overlap_trial_votes_on_a_rank_that_steps_nothing_ahead(results):
    """Rank 1 holds nothing trainable, so nothing of it is stepped ahead; it still ends
    each step of the trial and votes (no hang in the trial's all-reduce), both ranks
    end the same trials, and the training is bitwise that without overlap."""
    rank0, rank1 = results("trial_ranks", 0), results("trial_ranks", 1)
    assert rank0["has_step_ahead"] and not rank1["has_step_ahead"]
    assert rank0["trials"] == rank1["trials"] >= 2
    for got in (rank0, rank1):
        assert got["auto_losses"] == got["off_losses"]
        assert_same(got["auto_weights"], got["off_weights"])


# A compact format rounds each state element: to 2^-8 of its value in bf16, to at most
# 2^-3 of it in float8 e4m3 (3 mantissa bits). The two-rank and one-process runs differ
# in the gradients' reduction order (~1e-7 relative), which can move an element across
# a rounding boundary; that changes that element's Adam update by at most about one
# rounding step of it (|update| <= ~2 lr early in training), per step. So the weights
# agree within 2 * STEPS * lr * step (lr 3e-3); measured 1.3e-5 (bf16) and 1.9e-4
# (8bit) against bounds of 7.0e-5 and 2.3e-3. Host memory and disk agree bitwise.
COMPACT_STEP = {"bf16": 2.0**-8, "8bit": 2.0**-3}


@pytest.mark.parametrize("fmt", ["bf16", "8bit"])
def test_two_ranks_keep_compact_states_like_one_process(results, fmt):
    """optimizer_state_format bf16 / 8bit sharded over 2 ranks, host memory and disk:
    the same training as one process with the combined batch (within the rounding the
    format allows, above), host and disk bitwise equal, both ranks the same weights."""
    rank0, rank1 = results("compact", 0), results("compact", 1)
    bound = 2 * STEPS * 3e-3 * COMPACT_STEP[fmt]
    stored = {"bf16": ["torch.bfloat16"], "8bit": ["torch.float8_e4m3fn"]}[fmt]
    for where in ("cpu", "disk"):
        assert rank0[f"{fmt}_{where}_state_dtypes"] == stored  # the shards are compact
        torch.testing.assert_close(
            rank0[f"{fmt}_{where}_losses"], rank0[f"{fmt}_single_losses"], **CLOSE
        )
        assert_weights_close(
            rank0[f"{fmt}_{where}_weights"], rank0[f"{fmt}_single_weights"], rtol=0, atol=bound
        )
        assert_same(rank1[f"{fmt}_{where}_weights"], rank0[f"{fmt}_{where}_weights"])
    assert_same(rank0[f"{fmt}_disk_weights"], rank0[f"{fmt}_cpu_weights"])
    assert rank0[f"{fmt}_disk_losses"] == rank0[f"{fmt}_cpu_losses"]


@pytest.mark.parametrize("fmt", ["bf16", "8bit"])
@pytest.mark.parametrize("where", ["cpu", "disk"])
def test_a_sharded_checkpoint_of_compact_states_resumes_bitwise(results, fmt, where):
    """hetstore.save of compact states sharded over two ranks (each rank's shard decoded
    to fp32 in its file, as one process saves them), loaded into a new sharded model in
    the same format: the next step's losses and weights are bitwise those of the run
    that went on without stopping."""
    key = f"{fmt}_{where}"
    for rank in (0, 1):
        got = results("compact", rank)
        assert got[f"{key}_resumed_losses"] == got[f"{key}_continued_losses"]
        assert_same(got[f"{key}_resumed"], got[f"{key}_continued"])
        assert_same(got[f"{key}_continued"], results("compact", 0)[f"{key}_continued"])


@pytest.mark.parametrize("scenario", SCENARIOS)
def test_named_weights_over_two_ranks_are_the_state_dicts(results, scenario):
    """hetstore.named_weights on every rank (each unit all-gathered): the whole weights,
    bitwise model.state_dict()'s, the tied head once (under wte.weight)."""
    for rank in (0, 1):
        got = results(scenario, rank)
        named, state = got["named_weights"], got["sharded_weights"]
        assert named.keys() == state.keys() - {"head.weight"}
        assert_same(named, {k: state[k] for k in named})


@pytest.mark.parametrize("scenario", SCENARIOS)
def test_evict_restore_cycles_over_two_ranks_train_bitwise_like_none(results, scenario):
    """hetstore.evict / restore after every step on each rank: the same losses and
    weights, bitwise, as the sharded run without the cycles; no device byte left."""
    for rank in (0, 1):
        got = results(scenario, rank)
        assert got["evicted_losses"] == got["sharded_losses"]
        assert_same(got["evicted_weights"], got["sharded_weights"])
        assert got["evicted_device_after"] and set(got["evicted_device_after"]) == {0}
        if scenario == "none":  # each rank's shards of every state were on its device
            half = got["sharded_stats"]["device"]["current"]
            assert all(n >= half for n in got["evicted_bytes"]), (half, got["evicted_bytes"])


@pytest.mark.parametrize("scenario", SCENARIOS)
def test_each_rank_holds_about_half_of_the_single_process_states(results, scenario):
    single = results(scenario, 0)["single_stats"]
    print(f"\n{scenario}: single process {_usage(single)}")
    for rank in (0, 1):
        sharded = results(scenario, rank)["sharded_stats"]
        print(f"{scenario}: rank {rank} of 2    {_usage(sharded)}")
        for tier in ("device", "host", "disk"):
            alone, mine = single[tier]["current"], sharded[tier]["current"]
            if alone:  # half, plus at most one alignment quantum per unit and state
                assert 0.45 * alone <= mine <= 0.55 * alone, (tier, mine, alone)
            else:
                assert mine == 0, tier


def _usage(stats: dict) -> str:
    return ", ".join(
        f"{t} {stats[t]['current'] / 2**10:.0f} KiB" for t in ("device", "host", "disk")
    )


def test_ranks_keep_their_disk_files_apart(results):
    dirs = [results("disk", rank)["disk_dir"] for rank in (0, 1)]
    assert dirs[0] != dirs[1]
    assert "-rank0-" in dirs[0] and "-rank1-" in dirs[1]


def test_what_sharding_refuses_is_named(results):
    found = results("refusals", 0)
    assert "RMSprop" in found["rmsprop"] and "Adam, AdamW and SGD" in found["rmsprop"]
    assert "process_group must be" in found["bad_group"] and "str" in found["bad_group"]
    assert "hetstore.save" in found["optimizer_state_dict"]
    assert "'blocks.0.fc.weight'" in found["sharded_read"]
    assert "model.state_dict() on every rank" in found["sharded_read"]


@pytest.mark.parametrize("kind", ["die", "hang"])
def test_a_dead_or_hung_rank_gives_a_clear_error_within_the_timeout(tmp_path, kind):
    timeout = 5
    procs = start_ranks(
        2,
        ["--out", str(tmp_path), "--offload-path", str(tmp_path), "--fail", kind]
        + ["--timeout", str(timeout)],
    )
    try:
        output = procs[0].communicate(timeout=120)[0]
    finally:
        procs[1].kill()
        procs[1].wait()
    assert procs[0].returncode == 0, output[-3000:]
    seconds, message = (tmp_path / f"fail-{kind}.txt").read_text().split("\n", 1)
    assert message.startswith("DistributedError: rank 0 of 2: all-gather of the parameters")
    assert "init_process_group(timeout=...)" in message
    assert float(seconds) < timeout + 5  # the process group's timeout, not forever


# ---------------------------------------------------------------------- checkpoints
def assert_same(mine: dict, ref: dict) -> None:
    assert_weights_close(mine, ref, rtol=0, atol=0)


def test_a_two_rank_checkpoint_resumes_bitwise_on_two_ranks_in_another_placement(results):
    # saved from disk placement, loaded into host placement, both on 2 ranks
    for rank in (0, 1):
        found = results("checkpoint", rank)
        assert found["extra"] == {"step": 1}
        assert_same(found["loaded"], found["saved"])
        assert found["resumed"] == found["continued"]  # losses and clip norms, bitwise
        assert_same(found["resumed_weights"], found["continued_weights"])


def test_a_checkpoint_one_rank_refuses_is_refused_by_every_rank_at_once(results):
    # rank 1's copy has a changed byte in LATEST; rank 0's copy is sound
    mine, other = results("checkpoint", 1), results("checkpoint", 0)
    assert mine["split_verify"].startswith("CheckpointError") and "LATEST" in mine["split_verify"]
    assert other["split_verify"].startswith("CheckpointError")
    assert "rank 1 refused the checkpoint" in other["split_verify"]
    for found in (mine, other):
        assert found["split_verify_unchanged"]
        # well under the process group's 60 s timeout: nobody waited for a rank that left
        assert found["split_verify_s"] < 20, found["split_verify_s"]


def test_a_two_rank_checkpoint_loads_in_one_process_and_back(results):
    found = results("checkpoint", 0)
    # 2 ranks -> 1 process: the weights bitwise; the next steps as one process trains
    # the combined batch (the tolerance of the DDP-equivalence test, and why, above)
    assert_same(found["one_loaded"], found["saved"])
    torch.testing.assert_close(found["one_resumed"], found["continued"], **CLOSE)
    assert_weights_close(found["one_resumed_weights"], found["continued_weights"], **WEIGHTS)
    # 1 process -> 2 ranks
    assert_same(found["from_one_loaded"], found["one_saved"])
    torch.testing.assert_close(found["from_one_resumed"], found["one_continued"], **CLOSE)
    assert_weights_close(
        found["from_one_resumed_weights"], found["one_continued_weights"], **WEIGHTS
    )


def test_every_state_survives_two_ranks_to_one_bitwise(results):
    """The 2-rank checkpoint, loaded by one process and saved again: every parameter's
    master and optimizer state (pieces of both ranks joined) equal bitwise."""
    from hetstore.checkpoint.files import CheckpointReader
    from hetstore.checkpoint.training import LoadedCheckpoint

    out = results("dir", 0)
    two = LoadedCheckpoint(CheckpointReader(out / "ckpt-2ranks"))
    again = LoadedCheckpoint(CheckpointReader(out / "ckpt-resaved"))
    assert two.reader.meta["world_size"] == 2 and again.reader.meta["world_size"] == 1
    cut = [n for n, pieces in two.pieces.items() if len(pieces) > 1]
    assert cut  # some parameters were cut between the ranks' shards
    assert two.params.keys() == again.params.keys()
    for name, meta in two.params.items():
        assert (
            sorted(meta["states"])
            == sorted(again.params[name]["states"])
            == [
                "exp_avg",
                "exp_avg_sq",
                "step",
            ]
        )
        for key in [None, *meta["states"]]:
            assert torch.equal(two.read(name, key), again.read(name, key)), (name, key)
    two.close()
    again.close()


@pytest.mark.parametrize("where", ["cpu", "disk"])
def test_two_ranks_honour_unfreezing_and_refreezing(results, where):
    """tests/runtime/test_unfreeze.py's schedule over 2 ranks (blocks 0-1 frozen, unfrozen at
    step 2, frozen again at 4): the combined batch's plain PyTorch, within the sharded
    tolerances above; the frozen blocks moved only while unfrozen, on both ranks alike."""
    rank0, rank1 = results("unfreeze", 0), results("unfreeze", 1)
    torch.testing.assert_close(rank0[f"{where}_losses"], rank0["plain_losses"], **CLOSE)
    assert_weights_close(rank0[f"{where}_weights"], rank0["plain_weights"], **WEIGHTS)
    assert_weights_close(rank1[f"{where}_weights"], rank0[f"{where}_weights"], rtol=0, atol=0)
    initial, plain = rank0["initial_weights"], rank0["plain_weights"]
    assert (plain["blocks.0.fc.weight"] - initial["blocks.0.fc.weight"]).abs().max() > 1e-3


@pytest.mark.parametrize("placement", ["cpu", "disk"])
def test_a_frozen_bf16_base_sharded_over_two_ranks_has_no_fp32_master(results, placement):
    """A LoRA-shaped model (fc and proj of each block a frozen bf16 base outside the
    optimizer), bf16 compute, sharded over two ranks: each rank's master stops where its
    share of the base begins, and training is bitwise that of the same base kept in fp32
    with the same values (which gives every rank an fp32 master of it); the base never
    changes, the ranks agree, a sharded checkpoint loads back bitwise."""
    rank0, rank1 = results("frozen", 0), results("frozen", 1)
    for got in (rank0, rank1):
        bf16, fp32 = got[f"{placement}_bf16_weights"], got[f"{placement}_fp32_weights"]
        assert got[f"{placement}_bf16_losses"] == got[f"{placement}_fp32_losses"]
        assert bf16.keys() == fp32.keys()
        for name, value in bf16.items():
            assert torch.equal(value, fp32[name].to(value.dtype)), name
        for name, value in got[f"{placement}_base"].items():
            assert torch.equal(bf16[name], value), name  # (frozen: never changed)
        assert_same(got[f"{placement}_loaded"], bf16)
        # the fp32 base keeps a master of every element; the bf16 one, of none of its own
        assert got[f"{placement}_fp32_master_numel"] == got[f"{placement}_fp32_numel"]
    assert_same(rank1[f"{placement}_bf16_weights"], rank0[f"{placement}_bf16_weights"])
    # each block's base is its layout's tail, in rank 1's shard here: 2048 of its 16384
    # elements keep a master (rank 0's shards hold no base: all of theirs do)
    assert rank0[f"{placement}_bf16_master_numel"] == rank0[f"{placement}_bf16_numel"]
    short = [
        m < n
        for m, n in zip(
            rank1[f"{placement}_bf16_master_numel"], rank1[f"{placement}_bf16_numel"], strict=True
        )
    ]
    assert sum(short) == 3, short  # every block; the root has no base
