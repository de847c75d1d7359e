"""``OffloadConfig``: every knob of hetstore, validated once, before any work is done.

Its keys are MindSpore's heterogeneous-storage vocabulary (``offload_param``,
``offload_cpu_size``, ``host_mem_block_size``, ``hbm_ratio`` ...) plus ours for the parts
MindSpore does not split out (``offload_optimizer``, ``offload_activations`` ...).
Sizes are stored as ``int`` bytes; "GB" means GiB (see ``hetstore._sizes``).
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from hetstore._sizes import format_size
from hetstore.config_checks import (
    COMPUTE_DTYPES,
    STATE_FORMATS,  # noqa: F401 (named here for hetstore.optim.state_format, checkpoint)
    TIERS,
    cuda_with_index,  # noqa: F401 (named here for hetstore.tiers.device)
    reject_unknown_keys,
    resolve_device,
    validate,
)
from hetstore.config_sources import (
    MINDSPORE_KEYS,
    mapping_values,
    mindspore_values,
    read_config_file,
)
from hetstore.tier import Tier

__all__ = ["OffloadConfig", "TIERS", "COMPUTE_DTYPES"]
# (TIERS, COMPUTE_DTYPES, STATE_FORMATS: the allowed values, kept with their checks in
# hetstore.config_checks; MINDSPORE_KEYS with MindSpore's form in hetstore.config_sources)


def _doc(text: str) -> dict[str, str]:
    return {"doc": text}


@dataclass(frozen=True, kw_only=True, slots=True)
class OffloadConfig:
    """Where training state lives and how much of each tier hetstore may use.

    Example::

        OffloadConfig(offload_param="cpu", offload_optimizer="cpu",
                      max_device_memory="8GB", offload_path="./offload")

    Unknown keys, wrong types, out-of-range ratios and counts, unknown tiers and
    unparsable, negative or too large sizes raise :class:`hetstore.ConfigError` naming the
    key and what is allowed: always that error, and before anything is created. When the
    configuration can put anything on disk (a tier key is 'disk', or ``auto_offload``),
    ``offload_path`` is checked too, without creating it: not an existing non-directory,
    and its nearest existing ancestor writable and searchable by this process.
    """

    # --- placement (manual; with auto_offload they are initial placements / hints) ---
    offload_param: str = field(
        default="none",
        metadata=_doc(
            "Where parameters live between uses: 'none' (stay on device), 'cpu' (host "
            "memory, fetched before each use), 'disk' (files under offload_path). MindSpore key."
        ),
    )
    offload_optimizer: str = field(
        default="none",
        metadata=_doc(
            "Where fp32 master weights and optimizer states live and the step runs: "
            "'none' (device), 'cpu' (host, fused CPU kernel), 'disk' (streamed through host)."
        ),
    )
    offload_grad: str | None = field(
        default=None,
        metadata=_doc(
            "Where gradients go after backward. None: follow offload_optimizer (gradients "
            "are consumed where the optimizer steps), else 'none' | 'cpu' | 'disk'. 'disk' "
            "needs offload_optimizer='disk'; 'cpu' with a disk optimizer keeps 4 bytes per "
            "parameter in host memory and saves a disk write and read of them per step."
        ),
    )
    offload_activations: str = field(
        default="none",
        metadata=_doc(
            "Where tensors saved for backward go between forward and backward: "
            "'none' | 'cpu' | 'disk'."
        ),
    )
    auto_offload: bool = field(
        default=False,
        metadata=_doc(
            "Let the planner choose every unit's placement (parameters, optimizer states, "
            "activations, prefetch depth) from a trace of the model and the tier capacities. "
            "With hetstore.offload(..., example_inputs=...) the trace includes that batch's "
            "activations; without, the first training forward's batch is traced (on fake "
            "tensors) and planned for before it runs. The offload_* keys are then not used. "
            "MindSpore key."
        ),
    )
    # --- capacities ---
    max_device_memory: int | None = field(
        default=None,
        metadata=_doc(
            "Device budget in bytes (or '30GB'). None: the whole device (CUDA) or no "
            "hetstore limit (CPU). On CUDA also enforced with set_per_process_memory_fraction. "
            "MindSpore context key."
        ),
    )
    offload_cpu_size: int | None = field(
        default=None,
        metadata=_doc("Host memory hetstore may use. None: the machine's RAM. MindSpore key."),
    )
    offload_disk_size: int | None = field(
        default=None,
        metadata=_doc(
            "Disk space hetstore may use under offload_path. None: the free space at start. "
            "MindSpore key."
        ),
    )
    offload_path: str = field(
        default="./offload",
        metadata=_doc(
            "Directory for disk-tier files; a private 0700 sub-directory is made per process "
            "and rank and removed at exit. MindSpore key."
        ),
    )
    hbm_ratio: float = field(
        default=1.0,
        metadata=_doc(
            "Share of max_device_memory the automatic planner may fill, in (0, 1]. MindSpore key."
        ),
    )
    cpu_ratio: float = field(
        default=1.0,
        metadata=_doc(
            "Share of offload_cpu_size the automatic planner may fill, in (0, 1]. MindSpore key."
        ),
    )
    gpu_margin_mem_ratio: float = field(
        default=0.0,
        metadata=_doc(
            "Share of the device margin (budget minus peak non-model data) the planner may "
            "fill with optimizer states, in [0, 1] (ColossalAI/PatrickStar)."
        ),
    )
    # --- host memory ---
    host_mem_block_size: int = field(
        default=2**30,
        metadata=_doc(
            "Size of one block of the host memory pool; blocks are allocated lazily up to "
            "offload_cpu_size and sub-allocated into page-aligned slices. MindSpore key."
        ),
    )
    enable_pinned_mem: bool | str = field(
        default="auto",
        metadata=_doc(
            "Page-lock host blocks (cudaHostRegister) for fast async copies. 'auto': on a "
            "CUDA device, and silently not on a CPU one (nothing to speed up there). True: "
            "also warns when the device is not CUDA. Falls back to pageable memory with one "
            "warning when pinning fails (memlock limit). MindSpore key."
        ),
    )
    # --- disk IO ---
    enable_aio: bool = field(
        default=True,
        metadata=_doc(
            "Asynchronous disk IO (a worker pool of O_DIRECT preadv/pwritev at aio_queue_depth). "
            "False: plain synchronous IO. MindSpore key."
        ),
    )
    aio_block_size: int = field(
        default=8 * 2**20,
        metadata=_doc(
            "Bytes per disk IO request, at most 1 GiB; a transfer is split into requests "
            "of this size."
        ),
    )
    aio_queue_depth: int = field(
        default=32, metadata=_doc("Disk IO requests kept in flight at once, 1 to 1024.")
    )
    aio_threads: int = field(
        default=0,
        metadata=_doc(
            "Disk IO worker threads, 0 to 256; 0 picks a default from the queue depth and CPUs."
        ),
    )
    # --- compute ---
    compute_dtype: str = field(
        default="fp32",
        metadata=_doc(
            "dtype of parameters during forward/backward: 'fp32' | 'bf16' | 'fp16'. The "
            "optimizer keeps fp32 master weights of the trainable parameters (frozen "
            "ones already in this dtype are stored only in it); fp16 adds dynamic loss "
            "scaling."
        ),
    )
    device: str = field(
        default="auto",
        metadata=_doc("Compute device: 'auto' (cuda when available, else cpu), 'cpu', 'cuda[:N]'."),
    )
    prefetch_depth: int = field(
        default=1,
        metadata=_doc(
            "How many units ahead of the running one are fetched, 0 to 64. Units on disk keep "
            "prefetch_depth + 1 staging buffers of the largest unit's parameters in host memory."
        ),
    )
    activation_min_bytes: int = field(
        default=2**20,
        metadata=_doc(
            "Saved activations smaller than this (bytes of their storage) stay on the device "
            "when offload_activations is 'cpu' or 'disk': copying them costs more than it frees. "
            "With auto_offload the planner starts here and may lower it (64 KiB, 4 KiB, 0) "
            "where that fits a budget or is predicted faster; the plan says which it uses."
        ),
    )
    optimizer_chunk_size: int = field(
        default=32 * 2**20,
        metadata=_doc(
            "Bytes of one fp32 array per chunk when optimizer states on disk are streamed "
            "through host memory: the step holds 3 chunks of master, gradient and each "
            "optimizer state (about 12 x this for Adam with gradients on disk)."
        ),
    )
    optimizer_state_format: str = field(
        default="fp32",
        metadata=_doc(
            "How optimizer states (Adam's moments, SGD's momentum) are stored: 'fp32' "
            "(4 bytes per element, bitwise plain PyTorch), 'bf16' (2) or '8bit' (1 + 1/64: "
            "block-wise scaled 8-bit floats, second moments as square roots). The fp32 "
            "master weights are kept in every format; the update is torch's fused step on "
            "decoded fp32 chunks. Compact formats need Adam, AdamW or SGD; sharded over "
            "ranks, each rank keeps its shard's states in the format (its checkpoint file "
            "holds them decoded to fp32, as one process saves them)."
        ),
    )
    overlap_step: bool | str = field(
        default="auto",
        metadata=_doc(
            "Step units whose optimizer states and parameters are on disk as soon as "
            "backward has their gradients, beside the rest of backward (their step is disk "
            "IO), into shadow copies that optimizer.step() commits, or discards and steps "
            "again, when clipping, a changed hyper-parameter or another micro-batch changed "
            "what the step would read: exact either way. Units whose states are in host "
            "memory are never stepped in backward (a speculation there copies their master "
            "and states first); on a GPU they step in the next forward instead "
            "(step_in_forward). 'auto': that, and whether overlap pays at all is measured: "
            "after 20 steps, and every 500, a few steps run the other way (without it, nor "
            "step_in_forward='auto'; or with them, after a trial chose neither), kept only "
            "if each was faster than each of the steps before (speculation_stats: "
            "overlap_trials, without_overlap; optimizer.overlap_trial.restart() measures "
            "again at once, after the batch shape changed). True: the same, always, on any "
            "device; "
            "False: neither. Sharded units too (each rank its shard). A shadow holds one "
            "more copy of a unit's master and states on disk until the step, within the "
            "tier's room."
        ),
    )

    step_in_backward: bool = field(
        default=False,
        metadata=_doc(
            "Step each unit inside backward, as soon as its gradients are final, and keep "
            "no gradient for it. Units whose optimizer states are on disk: gradients never "
            "go to disk (4 bytes per parameter less there, 8 less disk traffic per step). "
            "Units whose optimizer states and parameters are in host memory "
            "(offload_optimizer='cpu', offload_param='cpu'): the ordinary step runs in "
            "place on the host beside the rest of backward, once the unit's gradients are "
            "there, and optimizer.step() waits for what is still running: on a GPU that "
            "hides the host step behind backward (the root unit, and units whose frozen "
            "weights backward still reads, are stepped in optimizer.step() or the next "
            "forward); on a CPU device, where the parameters are that host memory itself "
            "and backward may still read them, every unit is stepped in "
            "optimizer.step(). Exact "
            "(the same arithmetic as optimizer.step()), so it refuses what needs every "
            "gradient before any step: clipping, fp16 loss scaling, reading p.grad, a "
            "param group changed between backward and optimizer.step(), and a second "
            "backward before optimizer.step() (accumulate under hetstore.no_sync(model))."
        ),
    )

    step_in_forward: bool | str = field(
        default="auto",
        metadata=_doc(
            "Let optimizer.step() return before the steps of units whose optimizer states "
            "and parameters are on disk are done, and finish them during the next forward: "
            "each unit's step lands before its next use (forward, a read of its weights, "
            "state_dict(), p.grad, a checkpoint), so every reader sees the stepped values "
            "and the result is bitwise the ordinary step's. It hides the steps that "
            "overlap_step cannot hide in backward: after a clip that bit, "
            "rollbacks. A step that fails on its thread runs again at that use, and raises "
            "there if it fails again (not at optimizer.step()). On a GPU, units whose "
            "states and parameters are in host memory too: their ordinary step runs in "
            "place on the host beside the next forward, each before its unit's fetch (one "
            "that fails raises at that use, the unit partly stepped as after a failed "
            "optimizer.step()). 'auto': both, while overlap_step is not False. True: both, "
            "whatever overlap_step. False: every step is done when optimizer.step() "
            "returns."
        ),
    )

    def __post_init__(self) -> None:
        validate(self)  # (hetstore.config_checks: each key and its allowed values)

    # ------------------------------------------------------------------ derived
    @property
    def grad_tier(self) -> Tier:
        """Where gradients go: ``offload_grad`` if set, else ``offload_optimizer``."""
        return self.offload_grad if self.offload_grad is not None else self.offload_optimizer

    @property
    def torch_compute_dtype(self) -> torch.dtype:
        return COMPUTE_DTYPES[self.compute_dtype]

    @property
    def overlaps_disk_steps(self) -> bool:
        """``overlap_step``: units with states and parameters on disk step in backward."""
        return self.overlap_step is not False

    @property
    def steps_disk_in_forward(self) -> bool:
        """``step_in_forward``: what is left of the disk units' steps after backward
        finishes during the next forward ('auto': while ``overlap_step`` is on)."""
        if self.step_in_forward == "auto":
            return self.overlaps_disk_steps
        return self.step_in_forward

    def steps_memory_in_forward(self, device: torch.device | str | None = None) -> bool:
        """Units with states in host memory run their ordinary step in place during the
        next forward, on a GPU (on a CPU device that forward would compute on the cores
        the step needs): with ``step_in_forward=True``, and with 'auto' while
        ``overlap_step`` is not False (under 'auto' the overlap trial keeps it only while
        it is faster than none). During backward instead with ``step_in_backward``."""
        device = torch.device(device) if device is not None else self.resolved_device()
        return self.steps_disk_in_forward and device.type == "cuda"

    def resolved_device(self) -> torch.device:
        """The compute device: 'auto' becomes cuda when available, else cpu."""
        return resolve_device(self.device)  # (hetstore.config_checks)

    def replace(self, **changes: Any) -> OffloadConfig:
        """A copy with ``changes`` applied (validated like the constructor)."""
        return OffloadConfig(**{**self.to_dict(), **changes})

    def to_dict(self) -> dict[str, Any]:
        """Every key with its value; tiers as their plain spellings ('cpu'), so the
        dict serializes anywhere a config file can be read from."""
        return {f.name: _plain(getattr(self, f.name)) for f in dataclasses.fields(self)}

    def describe(self) -> str:
        """One line per key that differs from the default, sizes human-readable."""
        lines = []
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if value == f.default:
                continue
            if f.name in SIZE_KEYS and value is not None:
                value = f"{format_size(value)} ({value} bytes)"
            lines.append(f"{f.name} = {value}")
        return "\n".join(lines) or "(all defaults)"

    # ------------------------------------------------------------------ constructors
    @classmethod
    def keys(cls) -> tuple[str, ...]:
        return tuple(f.name for f in dataclasses.fields(cls))

    @classmethod
    def from_dict(cls, values: Mapping[str, Any], *, source: str = "config") -> OffloadConfig:
        return cls(**mapping_values(values, source))  # (hetstore.config_sources)

    @classmethod
    def from_mindspore(
        cls, offload_config: Mapping[str, Any] | None = None, **context: Any
    ) -> OffloadConfig:
        """Build from MindSpore's ``set_offload_context(offload_config=...)`` dict, verbatim.

        ``context`` takes the ``mindspore.set_context`` keys that matter here:
        ``max_device_memory``, and ``memory_offload`` ('ON' | 'OFF'; 'OFF' places
        everything on the device), and ``mode`` (accepted and ignored: hetstore runs
        eagerly). Any other OffloadConfig key may be given too, as an override.

        Mapping: MindSpore's "parameter" data covers weights *and* optimizer states (the
        guide: 模型的权重及优化器的状态量), so ``offload_param`` sets both
        ``offload_param`` and ``offload_optimizer`` unless the latter is given.
        """
        values = mindspore_values(offload_config, context)  # (hetstore.config_sources)
        return cls(**values)

    @classmethod
    def from_file(cls, path: str | os.PathLike) -> OffloadConfig:
        """Read a JSON, YAML or TOML file of OffloadConfig keys.

        A file whose top level has an ``offload_config`` mapping is read as MindSpore's
        form: that mapping plus the other top-level keys as context (``from_mindspore``).
        """
        data, name = read_config_file(path)  # (hetstore.config_sources)
        if "offload_config" in data:
            context = {k: v for k, v in data.items() if k != "offload_config"}
            return cls.from_mindspore(data["offload_config"], **context)
        return cls.from_dict(data, source=f"config file {name}")


# --------------------------------------------------------------------------- keys

SIZE_KEYS = frozenset(
    {
        "max_device_memory",
        "offload_cpu_size",
        "offload_disk_size",
        "host_mem_block_size",
        "aio_block_size",
        "optimizer_chunk_size",
    }
)


def _plain(value: Any) -> Any:
    return value.value if isinstance(value, Tier) else value


OffloadConfig.__init__ = reject_unknown_keys(OffloadConfig.__init__, OffloadConfig.keys())


_MINDSPORE_NOTE = {
    "max_device_memory": "`mindspore.set_context(max_device_memory=...)`",
    "offload_param": "same key; also sets `offload_optimizer` in `from_mindspore`",
}


def config_reference_markdown() -> str:
    """The table in docs/config.md, generated from the fields so the two never drift."""
    lines = [
        "# OffloadConfig reference",
        "",
        "Generated from `hetstore.config.config_reference_markdown()`; a test keeps this file",
        "in sync with the code.",
        "",
        'Sizes take an int (bytes) or a string with a unit: `"512GB"`, `"1.5GiB"`, `"100MB"`.',
        "**\"GB\" means GiB (2^30 bytes)**, as in MindSpore, whose `max_device_memory='30GB'`",
        "is binary (its OOM report prints 32GB as `32768M`); so a MindSpore config asks for",
        "the same budget here. Sizes are stored as `int` bytes.",
        "",
        "| key | default | MindSpore | meaning |",
        "|---|---|---|---|",
    ]
    for f in dataclasses.fields(OffloadConfig):
        default = f.default
        if f.name in SIZE_KEYS and isinstance(default, int):
            default = f"{default} ({format_size(default)})"
        ms = _MINDSPORE_NOTE.get(f.name, "same key" if f.name in MINDSPORE_KEYS else "—")
        doc = f.metadata["doc"].replace("|", "\\|")  # a pipe would end the table cell
        lines.append(f"| `{f.name}` | `{default!r}` | {ms} | {doc} |")
    lines += [
        "",
        "`OffloadConfig.from_mindspore(offload_config_dict, **context)` takes MindSpore's",
        "`set_offload_context(offload_config=...)` dict verbatim; `context` takes",
        "`max_device_memory`, `memory_offload` ('ON'/'OFF') and `mode` (ignored). MindSpore's",
        '"parameters" include optimizer states, so its `offload_param` sets both',
        "`offload_param` and `offload_optimizer` unless the latter is given.",
        "`OffloadConfig.from_file(path)` reads `.json`, `.yaml`/`.yml` or `.toml`.",
        "",
    ]
    return "\n".join(lines)
