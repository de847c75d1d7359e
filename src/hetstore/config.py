"""``OffloadConfig``: every knob of hetstore, validated once, before any work is done.

Its keys are MindSpore's heterogeneous-storage vocabulary (``offload_param``,
``offload_cpu_size``, ``host_mem_block_size``, ``hbm_ratio`` ...) plus ours for the parts
MindSpore does not split out (``offload_optimizer``, ``offload_activations`` ...).
Sizes are stored as ``int`` bytes; "GB" means GiB (see ``hetstore._sizes``).
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import json
import os
import stat
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from hetstore._sizes import format_size, parse_size, short_repr
from hetstore.errors import ConfigError
from hetstore.tier import Tier

__all__ = ["OffloadConfig", "TIERS", "COMPUTE_DTYPES"]

TIERS = tuple(t.value for t in Tier)  # the spellings the tier keys accept
COMPUTE_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
_DTYPE_ALIASES = {
    "float32": "fp32",
    "float": "fp32",
    "bfloat16": "bf16",
    "float16": "fp16",
    "half": "fp16",
}


def _doc(text: str) -> dict[str, str]:
    return {"doc": text}


# optimizer_state_format's values (what each means: hetstore.optim.state_format)
STATE_FORMATS = ("fp32", "bf16", "8bit")


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
            "Step units as soon as backward has their gradients, beside the rest of "
            "backward, into shadow copies that optimizer.step() commits, or discards and "
            "steps again, when clipping, a changed hyper-parameter or another micro-batch "
            "changed what the step would read: exact either way. 'auto': units whose "
            "states and parameters are on disk (their step is disk IO), and units whose "
            "states are in host memory when the compute device is a GPU (the host steps "
            "beside the GPU's backward; on a CPU device the two would share cores), and of "
            "those only as many as the host finishes before optimizer.step() comes, the "
            "rest stepped there (measured each step). True: both kinds, every unit, on "
            "any device; False: neither. Sharded units too (each rank its shard). A shadow "
            "holds "
            "one more copy of a unit's master and states (on disk, or in host memory) "
            "until the step, within the tier's room."
        ),
    )

    step_in_backward: bool = field(
        default=False,
        metadata=_doc(
            "Step each unit whose optimizer states are on disk inside backward, as soon as "
            "its gradients are final, and keep no gradient for it: gradients never go to "
            "disk (4 bytes per parameter less there, 8 less disk traffic per step). Exact "
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
            "overlap_step cannot hide in backward: after a clip that bit, the root unit's, "
            "rollbacks. A step that fails on its thread runs again at that use, and raises "
            "there if it fails again (not at optimizer.step()). 'auto': those disk units, "
            "while overlap_step is not False. True: those disk units with overlap_step "
            "False too, and on a GPU units whose states are in host memory as well: their "
            "ordinary step runs in place on the host beside the next forward, each before "
            "its unit's fetch (one that fails raises at that use, the unit partly stepped "
            "as after a failed optimizer.step()). False: every step is done when "
            "optimizer.step() returns."
        ),
    )

    def __post_init__(self) -> None:
        for key in ("offload_param", "offload_optimizer", "offload_activations"):
            _set(self, key, _tier(key, getattr(self, key)))
        if self.offload_grad is not None:
            _set(self, "offload_grad", _tier("offload_grad", self.offload_grad))
        for key in (
            "auto_offload",
            "enable_aio",
            "step_in_backward",
        ):
            _check_bool(key, getattr(self, key))
        for key in ("overlap_step", "step_in_forward", "enable_pinned_mem"):
            value = getattr(self, key)
            if not (isinstance(value, bool) or value == "auto"):
                raise ConfigError(f"{key}={short_repr(value)}: must be 'auto', True or False")
        for key in ("max_device_memory", "offload_cpu_size", "offload_disk_size"):
            value = getattr(self, key)
            if value is not None:
                _set(self, key, _size(key, value))
        for key in ("host_mem_block_size", "aio_block_size", "optimizer_chunk_size"):
            size = _size(key, getattr(self, key))
            if size < 4096 or size % 4096:
                raise ConfigError(
                    f"{key}={short_repr(getattr(self, key))}: must be a positive multiple of "
                    f"4096 bytes (disk IO is page-aligned), e.g. '1GB' or '8MB'"
                )
            if size > _MAX_BLOCK[key]:
                raise ConfigError(
                    f"{key}={short_repr(getattr(self, key))}: at most "
                    f"{format_size(_MAX_BLOCK[key])} (each is one buffer allocated whole)"
                )
            _set(self, key, size)
        for key, low_open in (("hbm_ratio", True), ("cpu_ratio", True)):
            _set(self, key, _ratio(key, getattr(self, key), low_open=low_open))
        _set(
            self,
            "gpu_margin_mem_ratio",
            _ratio("gpu_margin_mem_ratio", self.gpu_margin_mem_ratio, low_open=False),
        )
        for key, (low, high) in _INT_RANGES.items():
            _set(self, key, _int_in_range(key, getattr(self, key), low, high))
        _set(self, "activation_min_bytes", _size("activation_min_bytes", self.activation_min_bytes))
        _set(self, "offload_path", _path_string("offload_path", self.offload_path))
        _set(self, "compute_dtype", _compute_dtype(self.compute_dtype))
        _set(self, "device", _device(self.device))
        if self.optimizer_state_format not in STATE_FORMATS:
            raise ConfigError(
                f"optimizer_state_format={short_repr(self.optimizer_state_format)}: allowed "
                f"values are {', '.join(repr(f) for f in STATE_FORMATS)}"
            )
        if self.offload_grad is Tier.DISK and self.offload_optimizer is not Tier.DISK:
            raise ConfigError(
                f"offload_grad='disk' with offload_optimizer='{self.offload_optimizer}': "
                "gradients go to disk only when the optimizer steps from disk (they are read "
                "there, chunk by chunk); use offload_grad='cpu', or offload_optimizer='disk'"
            )
        if (
            self.step_in_backward
            and not self.auto_offload
            and self.offload_optimizer is not Tier.DISK
        ):
            raise ConfigError(
                f"step_in_backward=True with offload_optimizer='{self.offload_optimizer}': it "
                "steps units whose optimizer states are on disk; set offload_optimizer='disk' "
                "(with offload_param='disk'), or step_in_backward=False"
            )
        if self.step_in_backward and self.compute_dtype == "fp16":
            raise ConfigError(
                "step_in_backward=True with compute_dtype='fp16': fp16 loss scaling must see "
                "every gradient for overflow before any unit steps; use compute_dtype='bf16' "
                "or 'fp32', or step_in_backward=False"
            )
        if self.auto_offload or Tier.DISK in (
            self.offload_param,
            self.offload_optimizer,
            self.grad_tier,
            self.offload_activations,
        ):
            _check_usable_directory("offload_path", self.offload_path)

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

    def overlaps_memory_steps(self, device: torch.device | str | None = None) -> bool:
        """``overlap_step``: units with states in host memory step in backward (on the
        compute ``device``, the resolved one by default)."""
        if self.overlap_step == "auto":
            device = torch.device(device) if device is not None else self.resolved_device()
            return device.type == "cuda"
        return self.overlap_step

    @property
    def steps_disk_in_forward(self) -> bool:
        """``step_in_forward``: what is left of the disk units' steps after backward
        finishes during the next forward ('auto': while ``overlap_step`` is on)."""
        if self.step_in_forward == "auto":
            return self.overlaps_disk_steps
        return self.step_in_forward

    def steps_memory_in_forward(self, device: torch.device | str | None = None) -> bool:
        """``step_in_forward=True``: units with states in host memory finish their
        ordinary step during the next forward too, on a GPU (on a CPU device that forward
        would compute on the cores the step needs). Not under 'auto': not yet measured
        on a GPU."""
        device = torch.device(device) if device is not None else self.resolved_device()
        return self.step_in_forward is True and device.type == "cuda"

    def resolved_device(self) -> torch.device:
        """The compute device: 'auto' becomes cuda when available, else cpu."""
        if self.device == "auto":
            return cuda_with_index("cuda") if torch.cuda.is_available() else torch.device("cpu")
        dev = torch.device(self.device)
        if dev.type == "cuda":
            if not torch.cuda.is_available():
                raise ConfigError(
                    f"device={self.device!r}: CUDA is not available here; "
                    "use device='cpu' or 'auto'"
                )
            count = torch.cuda.device_count()
            if dev.index is not None and dev.index >= count:
                raise ConfigError(
                    f"device={self.device!r}: this machine has {count} CUDA device(s); "
                    f"allowed indexes are 0..{count - 1}"
                )
            return cuda_with_index(dev)
        return dev

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
        if not isinstance(values, Mapping):
            raise ConfigError(
                f"{source}: expected a mapping of OffloadConfig keys to values, got "
                f"{type(values).__name__} {short_repr(values)}"
            )
        values = dict(values)
        _check_str_keys(values, source)
        return cls(**values)

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
        if offload_config is None:
            offload_config = {}
        if not isinstance(offload_config, Mapping):
            raise ConfigError(
                f"offload_config: expected a dict of MindSpore offload keys to values, got "
                f"{type(offload_config).__name__} {short_repr(offload_config)}"
            )
        offload_config = dict(offload_config)
        _check_str_keys(offload_config, "offload_config")
        for key in offload_config:
            if key not in MINDSPORE_KEYS:
                raise ConfigError(
                    f"offload_config key {short_repr(key)} is not a MindSpore offload key; "
                    f"allowed: {', '.join(sorted(MINDSPORE_KEYS))}"
                    f"{_did_you_mean(key, MINDSPORE_KEYS)}"
                )
        context = dict(context)
        context.pop("mode", None)
        memory_offload = context.pop("memory_offload", "ON")
        if not isinstance(memory_offload, str) or memory_offload not in ("ON", "OFF"):
            raise ConfigError(
                f"memory_offload={short_repr(memory_offload)}: allowed values are 'ON' and 'OFF'"
            )
        values = {**offload_config, **context}
        if "offload_param" in offload_config and "offload_optimizer" not in values:
            values["offload_optimizer"] = offload_config["offload_param"]
        if memory_offload == "OFF":
            values.update(offload_param="none", offload_optimizer="none", auto_offload=False)
        return cls(**values)

    @classmethod
    def from_file(cls, path: str | os.PathLike) -> OffloadConfig:
        """Read a JSON, YAML or TOML file of OffloadConfig keys.

        A file whose top level has an ``offload_config`` mapping is read as MindSpore's
        form: that mapping plus the other top-level keys as context (``from_mindspore``).
        """
        if not isinstance(path, str | os.PathLike):
            raise ConfigError(
                f"config file: expected a path (str or os.PathLike), got "
                f"{type(path).__name__} {short_repr(path)}"
            )
        try:
            path = Path(path)
        except TypeError as exc:  # a PathLike whose __fspath__ returns bytes
            raise ConfigError(f"config file {short_repr(path)}: not a usable path: {exc}") from None
        name = short_repr(str(path), limit=200)
        suffix = path.suffix.lower()
        if suffix not in (".json", ".yaml", ".yml", ".toml"):
            raise ConfigError(
                f"config file {name}: unknown extension {short_repr(suffix)}; "
                f"use .json, .yaml, .yml or .toml"
            )
        try:
            text = path.read_text(encoding="utf-8")
        except OSError as exc:
            raise ConfigError(f"cannot read config file {name}: {exc.strerror or exc}") from exc
        except UnicodeDecodeError as exc:
            raise ConfigError(f"config file {name} is not UTF-8 text: {exc}") from None
        except ValueError as exc:  # a NUL byte in the path
            raise ConfigError(f"cannot read config file {name}: {exc}") from None
        if suffix == ".json":
            parse = json.loads
        elif suffix == ".toml":
            try:
                import tomllib
            except ModuleNotFoundError:  # Python 3.10
                try:
                    import tomli as tomllib
                except ModuleNotFoundError:
                    raise ConfigError(
                        f"config file {name}: reading TOML on Python 3.10 needs the tomli "
                        f"package (pip install tomli), or use a .json file"
                    ) from None
            parse = tomllib.loads
        else:
            try:
                import yaml
            except ModuleNotFoundError:
                raise ConfigError(
                    f"config file {name}: reading YAML needs PyYAML (pip install pyyaml), "
                    f"or use a .json file"
                ) from None
            parse = yaml.safe_load
        try:
            data = parse(text)
        except Exception as exc:  # each parser has its own error type
            raise ConfigError(f"config file {name} is not valid {suffix[1:]}: {exc}") from exc
        if not isinstance(data, dict):
            raise ConfigError(
                f"config file {name}: expected a mapping of OffloadConfig keys at the top "
                f"level, got {type(data).__name__}"
            )
        _check_str_keys(data, f"config file {name}")
        if "offload_config" in data:
            context = {k: v for k, v in data.items() if k != "offload_config"}
            return cls.from_mindspore(data["offload_config"], **context)
        return cls.from_dict(data, source=f"config file {name}")


# --------------------------------------------------------------------------- validation

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
MINDSPORE_KEYS = frozenset(
    {
        "offload_param",
        "auto_offload",
        "offload_cpu_size",
        "offload_disk_size",
        "offload_path",
        "host_mem_block_size",
        "enable_aio",
        "enable_pinned_mem",
        "hbm_ratio",
        "cpu_ratio",
    }
)


def _set(config: OffloadConfig, key: str, value: Any) -> None:
    object.__setattr__(config, key, value)


def _did_you_mean(key: str, allowed: frozenset[str] | tuple[str, ...]) -> str:
    close = difflib.get_close_matches(key, sorted(allowed), n=1, cutoff=0.6)
    return f" (did you mean {close[0]!r}?)" if close else ""


# Counts, with bounds that keep every use of them finite: ``prefetch_depth`` sets loops
# over units and ``prefetch_depth + 1`` staging buffers; the disk engine starts
# ``min(aio_threads or default, aio_queue_depth)`` threads.
_INT_RANGES = {
    "aio_queue_depth": (1, 1024),
    "aio_threads": (0, 256),
    "prefetch_depth": (0, 64),
}

# Block sizes are single allocations: an IO request's bounce buffer (aio_block_size),
# one host mapping (host_mem_block_size, further capped by the host tier's room), one
# chunk of the streamed step per array (optimizer_chunk_size, capped by the unit's size).
# The bounds refuse sizes no machine can allocate before anything is built.
_MAX_BLOCK = {
    "aio_block_size": 2**30,
    "host_mem_block_size": 2**40,
    "optimizer_chunk_size": 2**40,
}


def _check_str_keys(values: Mapping[Any, Any], source: str) -> None:
    for key in values:
        if not isinstance(key, str):
            raise ConfigError(
                f"{source}: key {short_repr(key)} ({type(key).__name__}) is not a string; "
                f"keys are OffloadConfig key names such as 'offload_param'"
            )


def _plain(value: Any) -> Any:
    return value.value if isinstance(value, Tier) else value


def _tier(key: str, value: Any) -> Tier:
    if isinstance(value, str) and value.lower() in TIERS:
        return Tier(value.lower())
    raise ConfigError(
        f"{key}={short_repr(value)}: allowed values are {', '.join(map(repr, TIERS))}"
    )


def _check_bool(key: str, value: Any) -> None:
    if not isinstance(value, bool):
        raise ConfigError(f"{key}={short_repr(value)}: must be True or False")


def _int_in_range(key: str, value: Any, low: int, high: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise ConfigError(f"{key}={short_repr(value)}: must be an integer >= {low} and <= {high}")
    return int(value)


def _size(key: str, value: Any) -> int:
    try:
        return parse_size(value)
    except ValueError as exc:
        raise ConfigError(f"{key}={short_repr(value)}: {exc}") from None


def _ratio(key: str, value: Any, *, low_open: bool) -> float:
    interval = "(0, 1]" if low_open else "[0, 1]"
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ConfigError(f"{key}={short_repr(value)}: must be a number in {interval}")
    if not (0.0 <= value <= 1.0) or (low_open and value == 0.0):  # NaN fails both
        raise ConfigError(f"{key}={short_repr(value)}: must be in {interval}")
    return float(value)


def _path_string(key: str, value: Any) -> str:
    """``value`` as a ``str`` path, refused when no file system could take it."""
    if isinstance(value, os.PathLike):
        try:
            value = os.fspath(value)
        except Exception as exc:
            raise ConfigError(f"{key}: os.fspath() of {short_repr(value)} failed: {exc}") from None
    if not isinstance(value, str) or not value:
        raise ConfigError(
            f"{key}={short_repr(value)}: must be a non-empty directory path "
            f"(a str or os.PathLike of str)"
        )
    if "\0" in value:
        raise ConfigError(
            f"{key}={short_repr(value)}: contains a NUL character, which no file name can hold"
        )
    try:
        os.fsencode(value)
    except UnicodeError:
        raise ConfigError(
            f"{key}={short_repr(value)}: cannot be encoded as a file name on this system"
        ) from None
    return str(value)


def _check_usable_directory(key: str, path: str) -> None:
    """Refuse ``path`` unless this process could create it (or use it) as a directory:
    it is not an existing non-directory, and its nearest existing ancestor (itself when it
    exists) is a directory this process may write and search. Creates nothing."""
    try:
        target = os.path.abspath(path)
    except OSError as exc:  # a relative path while the working directory was removed
        raise ConfigError(
            f"{key}={short_repr(path)}: cannot resolve it ({exc.strerror or exc}); give an "
            f"absolute path"
        ) from None
    probe = target
    while True:
        try:
            st = os.stat(probe)
            break
        except (FileNotFoundError, NotADirectoryError):
            # NotADirectoryError: a component above is a file; going up finds and names it.
            if os.path.islink(probe):
                raise ConfigError(
                    f"{key}={short_repr(path)}: {probe!r} is a symbolic link to nothing, so "
                    f"the directory cannot be created; remove the link or choose another path"
                ) from None
            parent = os.path.dirname(probe)
            if parent == probe:  # cannot happen for an absolute path, but never loop
                raise ConfigError(f"{key}={short_repr(path)}: no existing ancestor") from None
            probe = parent
        except OSError as exc:  # EACCES on a parent, ELOOP, ENAMETOOLONG...
            raise ConfigError(
                f"{key}={short_repr(path)}: cannot inspect {probe!r} ({exc.strerror or exc}); "
                f"point {key} at a directory this process can create and write"
            ) from None
    if not stat.S_ISDIR(st.st_mode):
        if probe == target:
            raise ConfigError(
                f"{key}={short_repr(path)}: {probe!r} exists and is not a directory; "
                f"point {key} at a directory (it is created if missing)"
            )
        raise ConfigError(
            f"{key}={short_repr(path)}: {probe!r} is not a directory, so {target!r} cannot be "
            f"created under it; point {key} at a directory"
        )
    effective = os.access in os.supports_effective_ids
    if not os.access(probe, os.W_OK | os.X_OK, effective_ids=effective):
        where = (
            f"the directory {probe!r}"
            if probe == target
            else f"{target!r} does not exist and its nearest existing ancestor {probe!r}"
        )
        raise ConfigError(
            f"{key}={short_repr(path)}: {where} is not writable and searchable by this "
            f"process (uid {os.geteuid()}); point {key} at a directory you can write, or "
            f"create it with write permission"
        )


def _compute_dtype(value: Any) -> str:
    if isinstance(value, torch.dtype):
        for name, dtype in COMPUTE_DTYPES.items():
            if dtype == value:
                return name
    if isinstance(value, str):
        name = _DTYPE_ALIASES.get(value.lower(), value.lower())
        if name in COMPUTE_DTYPES:
            return name
    raise ConfigError(
        f"compute_dtype={short_repr(value)}: allowed values are 'fp32', 'bf16', 'fp16' "
        f"(or the torch dtypes float32, bfloat16, float16)"
    )


def _device(value: Any) -> str:
    if isinstance(value, torch.device):
        value = str(value)
    if isinstance(value, str):
        if value == "auto":
            return value
        try:
            dev = torch.device(value)
        except Exception:  # torch's parser raises RuntimeError, ValueError or TypeError
            dev = None
        if dev is not None and dev.type in ("cpu", "cuda"):
            return str(dev)
    raise ConfigError(
        f"device={short_repr(value)}: allowed values are 'auto', 'cpu', 'cuda', 'cuda:N'"
    )


def _reject_unknown_keys(init):
    """Wrap the generated __init__ so unknown keywords raise ConfigError, not TypeError."""
    allowed = frozenset(OffloadConfig.keys())

    @functools.wraps(init)
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        if args:
            raise ConfigError(
                "OffloadConfig takes keyword arguments only, e.g. OffloadConfig(offload_param='cpu')"
            )
        for key in kwargs:
            if key not in allowed:
                raise ConfigError(
                    f"unknown OffloadConfig key {short_repr(key)}{_did_you_mean(key, allowed)}; "
                    f"allowed keys: {', '.join(sorted(allowed))}"
                )
        init(self, **kwargs)

    return __init__


OffloadConfig.__init__ = _reject_unknown_keys(OffloadConfig.__init__)


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


def cuda_with_index(device: str | torch.device) -> torch.device:
    """``cuda`` with its index made explicit (the current device when none was given).
    Why: some CUDA calls (``set_per_process_memory_fraction``) refuse a bare 'cuda', and
    a model's device must not change if the user later switches the current device."""
    dev = torch.device(device)
    if dev.type != "cuda" or dev.index is not None:
        return dev
    return torch.device("cuda", torch.cuda.current_device())
