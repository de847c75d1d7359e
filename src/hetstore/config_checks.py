"""The checks of :class:`~hetstore.config.OffloadConfig`'s keys and values.

``OffloadConfig`` (:mod:`hetstore.config`) is the public, documented configuration: its
fields, defaults and what each means. What each key *accepts* is here: the allowed
values (tiers, compute dtypes, state formats, ``'auto'`` / True / False), the ranges of
ratios and counts, sizes parsed to ``int`` bytes and bounded, ``offload_path`` checked
without creating it, and the combinations refused. :func:`validate` runs them all once,
from ``OffloadConfig.__post_init__``, and stores the normalized values (tiers as
:class:`~hetstore.tier.Tier`, sizes as bytes, dtype and device spellings) in the frozen
config; :func:`reject_unknown_keys` makes an unknown keyword a ``ConfigError`` naming
the closest key. Every refusal is a :class:`hetstore.ConfigError` naming the key and what
is allowed.
"""

from __future__ import annotations

import difflib
import functools
import os
import stat
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import torch

from hetstore._sizes import format_size, parse_size, short_repr
from hetstore.errors import ConfigError
from hetstore.tier import Tier

if TYPE_CHECKING:
    from hetstore.config import OffloadConfig

__all__ = [
    "COMPUTE_DTYPES",
    "STATE_FORMATS",
    "TIERS",
    "check_str_keys",
    "did_you_mean",
    "cuda_with_index",
    "reject_unknown_keys",
    "resolve_device",
    "validate",
]

TIERS = tuple(t.value for t in Tier)  # the spellings the tier keys accept
COMPUTE_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
_DTYPE_ALIASES = {
    "float32": "fp32",
    "float": "fp32",
    "bfloat16": "bf16",
    "float16": "fp16",
    "half": "fp16",
}

# optimizer_state_format's values (what each means: hetstore.optim.state_format)
STATE_FORMATS = ("fp32", "bf16", "8bit")


def validate(config: OffloadConfig) -> None:
    """Check every key of ``config`` and store its normalized value (see the module
    doc); raises ConfigError at the first key refused."""
    for key in ("offload_param", "offload_optimizer", "offload_activations"):
        _set(config, key, _tier(key, getattr(config, key)))
    if config.offload_grad is not None:
        _set(config, "offload_grad", _tier("offload_grad", config.offload_grad))
    for key in (
        "auto_offload",
        "enable_aio",
        "step_in_backward",
    ):
        _check_bool(key, getattr(config, key))
    for key in ("overlap_step", "step_in_forward", "enable_pinned_mem"):
        value = getattr(config, key)
        if not (isinstance(value, bool) or value == "auto"):
            raise ConfigError(f"{key}={short_repr(value)}: must be 'auto', True or False")
    for key in ("max_device_memory", "offload_cpu_size", "offload_disk_size"):
        value = getattr(config, key)
        if value is not None:
            _set(config, key, _size(key, value))
    for key in ("host_mem_block_size", "aio_block_size", "optimizer_chunk_size"):
        size = _size(key, getattr(config, key))
        if size < 4096 or size % 4096:
            raise ConfigError(
                f"{key}={short_repr(getattr(config, key))}: must be a positive multiple of "
                f"4096 bytes (disk IO is page-aligned), e.g. '1GB' or '8MB'"
            )
        if size > _MAX_BLOCK[key]:
            raise ConfigError(
                f"{key}={short_repr(getattr(config, key))}: at most "
                f"{format_size(_MAX_BLOCK[key])} (each is one buffer allocated whole)"
            )
        _set(config, key, size)
    for key, low_open in (("hbm_ratio", True), ("cpu_ratio", True)):
        _set(config, key, _ratio(key, getattr(config, key), low_open=low_open))
    _set(
        config,
        "gpu_margin_mem_ratio",
        _ratio("gpu_margin_mem_ratio", config.gpu_margin_mem_ratio, low_open=False),
    )
    for key, (low, high) in _INT_RANGES.items():
        _set(config, key, _int_in_range(key, getattr(config, key), low, high))
    _set(config, "activation_min_bytes", _size("activation_min_bytes", config.activation_min_bytes))
    _set(config, "offload_path", _path_string("offload_path", config.offload_path))
    _set(config, "compute_dtype", _compute_dtype(config.compute_dtype))
    _set(config, "device", _device(config.device))
    if config.optimizer_state_format not in STATE_FORMATS:
        raise ConfigError(
            f"optimizer_state_format={short_repr(config.optimizer_state_format)}: allowed "
            f"values are {', '.join(repr(f) for f in STATE_FORMATS)}"
        )
    if config.offload_grad is Tier.DISK and config.offload_optimizer is not Tier.DISK:
        raise ConfigError(
            f"offload_grad='disk' with offload_optimizer='{config.offload_optimizer}': "
            "gradients go to disk only when the optimizer steps from disk (they are read "
            "there, chunk by chunk); use offload_grad='cpu', or offload_optimizer='disk'"
        )
    if (
        config.step_in_backward
        and not config.auto_offload
        and config.offload_optimizer is not Tier.DISK
        and (config.offload_optimizer, config.offload_param) != (Tier.HOST, Tier.HOST)
    ):
        raise ConfigError(
            f"step_in_backward=True with offload_optimizer='{config.offload_optimizer}' and "
            f"offload_param='{config.offload_param}': it steps units whose optimizer states "
            "are on disk, or in host memory with the parameters fetched from there; set "
            "offload_optimizer='disk' (with offload_param='disk'), or "
            "offload_optimizer='cpu' with offload_param='cpu', or step_in_backward=False"
        )
    if config.step_in_backward and config.compute_dtype == "fp16":
        raise ConfigError(
            "step_in_backward=True with compute_dtype='fp16': fp16 loss scaling must see "
            "every gradient for overflow before any unit steps; use compute_dtype='bf16' "
            "or 'fp32', or step_in_backward=False"
        )
    if config.auto_offload or Tier.DISK in (
        config.offload_param,
        config.offload_optimizer,
        config.grad_tier,
        config.offload_activations,
    ):
        _check_usable_directory("offload_path", config.offload_path)


def _set(config: OffloadConfig, key: str, value: Any) -> None:
    object.__setattr__(config, key, value)


def did_you_mean(key: str, allowed: frozenset[str] | tuple[str, ...]) -> str:
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


def check_str_keys(values: Mapping[Any, Any], source: str) -> None:
    for key in values:
        if not isinstance(key, str):
            raise ConfigError(
                f"{source}: key {short_repr(key)} ({type(key).__name__}) is not a string; "
                f"keys are OffloadConfig key names such as 'offload_param'"
            )


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


def reject_unknown_keys(init, keys: tuple[str, ...]):
    """Wrap the generated __init__ so unknown keywords raise ConfigError, not TypeError
    (``keys``: ``OffloadConfig.keys()``)."""
    allowed = frozenset(keys)

    @functools.wraps(init)
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        if args:
            raise ConfigError(
                "OffloadConfig takes keyword arguments only, e.g. OffloadConfig(offload_param='cpu')"
            )
        for key in kwargs:
            if key not in allowed:
                raise ConfigError(
                    f"unknown OffloadConfig key {short_repr(key)}{did_you_mean(key, allowed)}; "
                    f"allowed keys: {', '.join(sorted(allowed))}"
                )
        init(self, **kwargs)

    return __init__


def resolve_device(device: str) -> torch.device:
    """The compute device ``device`` (a checked spelling) names on this machine: 'auto'
    becomes cuda when available, else cpu; a CUDA device must exist here."""
    if device == "auto":
        return cuda_with_index("cuda") if torch.cuda.is_available() else torch.device("cpu")
    dev = torch.device(device)
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise ConfigError(
                f"device={device!r}: CUDA is not available here; use device='cpu' or 'auto'"
            )
        count = torch.cuda.device_count()
        if dev.index is not None and dev.index >= count:
            raise ConfigError(
                f"device={device!r}: this machine has {count} CUDA device(s); "
                f"allowed indexes are 0..{count - 1}"
            )
        return cuda_with_index(dev)
    return dev


def cuda_with_index(device: str | torch.device) -> torch.device:
    """``cuda`` with its index made explicit (the current device when none was given).
    Why: some CUDA calls (``set_per_process_memory_fraction``) refuse a bare 'cuda', and
    a model's device must not change if the user later switches the current device."""
    dev = torch.device(device)
    if dev.type != "cuda" or dev.index is not None:
        return dev
    return torch.device("cuda", torch.cuda.current_device())
