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


def test_while_a_bound_lives_the_heap_keeps_what_its_tensors_free():
    """The bound is the heap's only trim: glibc's own gives the heap's top back whenever
    more than twice its (rising) mmap threshold is free there, which a few units' freed
    ~30 MiB device copies make, and the next fetches fault them in afresh (about 1.4 ms
    a MiB on this machine's VM). Measured as the resident set right after 96 MiB of
    tensors are freed at the heap's top: kept, not given back. (Counting the next
    tensors' page faults instead depends on where posix_memalign's padding leaves each
    freed chunk: now and then one is a few bytes short for the next request of its size
    and that one comes from fresh pages, kept heap or not.)"""
    import torch

    def resident_after_freeing_four_24_mib_tensors() -> tuple[int, int]:
        tensors = [torch.empty(24 * MiB, dtype=torch.uint8) for _ in range(4)]
        for t in tensors:
            t.fill_(1)  # touched
        holding = current_rss()
        del tensors, t  # freed together: 96 MiB at the heap's top
        return holding, current_rss()

    bound = HeapBound(current_rss(), lambda: 0, slack=4096 * MiB)
    resident_after_freeing_four_24_mib_tensors()  # (the heap grows to hold them once)
    holding, after = resident_after_freeing_four_24_mib_tensors()
    assert holding - after < 8 * MiB  # of 96 MiB freed
    del bound


def test_release_gives_the_heap_back_to_glibc_while_the_optimizer_lives_on(tmp_path):
    """A released model's bound goes with it, not when its optimizer (which the user may
    keep) is collected: the hooks that asked the bound to trim are gone, so nothing else
    would ever trim for it."""
    import hetstore
    from hetstore._malloc import live_bounds
    from tests.models.gpt import batches
    from tests.optim.helpers import config, fresh

    model, optimizer = fresh()  # everything on disk: the process's memory is bounded
    model, optimizer = hetstore.offload(model, optimizer, config(tmp_path, True, "disk"))
    x, y = batches(1)[0]
    model(x, y).backward()
    optimizer.step()
    before = live_bounds()
    assert hetstore.state_of(model).runtime.heap_bound is not None and before >= 1
    hetstore.release(model)
    assert live_bounds() == before - 1
    assert optimizer is not None  # (still referenced here)
