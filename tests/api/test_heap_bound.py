"""``HeapBound`` (hetstore._malloc): the C heap's freed pages go back to the OS only when
the process holds more than its baseline, what the tiers hold and the slack. The budget
it keeps is tested from outside in tests/api/test_rss_budgets.py; here, its trigger."""

from __future__ import annotations

from hetstore._malloc import HeapBound, current_rss

MiB = 2**20


def test_it_trims_only_past_baseline_plus_held_plus_slack():
    rss = current_rss()
    assert rss is not None and rss > 0
    roomy = HeapBound(rss, lambda: 64 * MiB, slack=64 * MiB)  # far above the process now
    roomy.check()
    assert roomy.trims == 0
    tight = HeapBound(0, lambda: 0, slack=MiB)  # the process is far above 1 MiB
    tight.check()
    assert tight.trims == 1


def test_memory_a_trim_cannot_return_becomes_the_baseline():
    """Live memory outside hetstore (a second model, a dataset) is above the bound for
    good: one trim finds that out, and the bound stops trimming after every unit for it."""
    bound = HeapBound(0, lambda: 0, slack=MiB)  # everything the process holds is "over"
    bound.check()
    bound.check()
    bound.check()
    assert bound.trims == 1


def test_while_a_bound_lives_freed_heap_memory_serves_the_next_tensor_without_faults():
    """The bound is the heap's only trim: glibc's own (its trim threshold, its mmap
    threshold for requests up to 32 MiB) would give a unit's freed ~30 MiB copy back and
    fault it in afresh at the next fetch (about 1.4 ms a MiB on this machine's VM)."""
    import resource

    import torch

    def faults_of_a_fresh_24_mib_tensor() -> int:
        before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        torch.empty(24 * MiB, dtype=torch.uint8).fill_(1)  # made, touched, freed
        return resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before

    bound = HeapBound(current_rss(), lambda: 0, slack=1024 * MiB)
    faults_of_a_fresh_24_mib_tensor()  # the heap grows once
    assert faults_of_a_fresh_24_mib_tensor() < 24 * MiB // 4096 // 10  # (6144 pages)
    del bound
