"""The host staging the runtime's disk paths allocate, as functions of sizes.

The components size their buffers from here (``api`` for the parameter and gradient
stagers, ``optim.streamed`` for the step's chunk buffers) and the cost model predicts
from here, so prediction and allocation cannot drift apart, and the planner needs no
import of the runtime. A leaf module: numbers in, bytes out.
"""

from __future__ import annotations

__all__ = [
    "GRAD_STAGING_SLOTS",
    "STREAMED_STEP_SLOT_SETS",
    "param_staging_slots",
    "param_staging_bytes",
    "grad_staging_bytes",
    "streamed_step_bytes",
    "activation_staging_units",
]

# gradient staging of disk-gradient units: the unit whose write is in flight, the one
# filling, and one for the next unit's first gradient arriving meanwhile
GRAD_STAGING_SLOTS = 3
# step_in_forward after a clip that bit: the first units the next forward uses whose
# masters and optimizer states are read into host memory during backward (whose disk
# is mostly idle), so that forward does not wait for those reads (optim.step_ahead)
READ_AHEAD_UNITS = 4
# the streamed step: chunk i is stepped while chunk i+1 is read and chunk i-1 written
STREAMED_STEP_SLOT_SETS = 3


def param_staging_slots(prefetch_depth: int) -> int:
    """Parameter staging buffers of disk-home units: the running unit and the prefetched."""
    return prefetch_depth + 1


def param_staging_bytes(prefetch_depth: int, largest_home_bytes: int) -> int:
    return param_staging_slots(prefetch_depth) * largest_home_bytes


def activation_staging_units(prefetch_depth: int) -> int:
    """Units of disk-bound activations in host staging at once: in forward the unit
    running and the one before it (runtime.activations settles a group's writes when
    the next-but-one group begins), in backward the unit restored and the
    ``prefetch_depth`` read ahead."""
    return max(2, prefetch_depth + 1)


def grad_staging_bytes(largest_grad_bytes: int) -> int:
    return GRAD_STAGING_SLOTS * largest_grad_bytes


def streamed_step_bytes(
    master_numel: int,
    state_count: int,
    chunk_numel: int,
    *,
    grad_on_disk: bool,
    home_itemsize: int,
    state_itemsize: float = 4.0,
) -> int:
    """Host bytes of one unit's streamed step: buffer sets of one chunk for the fp32
    master, each state (read in its stored format, ``state_itemsize`` bytes an element,
    and stepped in fp32 when that is compact), the fp32 gradient when it is on disk, and
    the home's cast (``home_itemsize``: 0 when the home is not a separate disk array)."""
    if master_numel <= 0:
        return 0
    chunk = max(1, min(chunk_numel, master_numel))
    sets = min(STREAMED_STEP_SLOT_SETS, -(-master_numel // chunk))
    per_state = 4 if state_itemsize >= 4 else 4 + state_itemsize  # + the fp32 scratch
    per_element = 4 * (1 + int(grad_on_disk)) + state_count * per_state + home_itemsize
    return int(sets * chunk * per_element)
