"""OffloadConfig's other sources: MindSpore's offload settings and config files.

:class:`~hetstore.config.OffloadConfig` builds itself from keyword arguments or a
mapping of its keys; its constructors ``from_mindspore`` and ``from_file`` come here
first: :func:`mindspore_values` turns MindSpore's ``set_offload_context(offload_config=
...)`` dict and ``set_context`` keys into OffloadConfig keys, and :func:`read_config_file`
reads a JSON, YAML or TOML file into a mapping. Both refuse what they cannot read with a
:class:`hetstore.ConfigError`; the keys' values are checked by the config itself
(:mod:`hetstore.config_checks`).
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from hetstore._sizes import short_repr
from hetstore.config_checks import check_str_keys, did_you_mean
from hetstore.errors import ConfigError

__all__ = ["MINDSPORE_KEYS", "mapping_values", "mindspore_values", "read_config_file"]

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


def mapping_values(values: Mapping[str, Any], source: str) -> dict[str, Any]:
    """``values``, a mapping of OffloadConfig keys, as a dict (see
    ``OffloadConfig.from_dict``); ``source`` names it in messages."""
    if not isinstance(values, Mapping):
        raise ConfigError(
            f"{source}: expected a mapping of OffloadConfig keys to values, got "
            f"{type(values).__name__} {short_repr(values)}"
        )
    values = dict(values)
    check_str_keys(values, source)
    return values


def mindspore_values(
    offload_config: Mapping[str, Any] | None, context: dict[str, Any]
) -> dict[str, Any]:
    """OffloadConfig keys and values from MindSpore's offload dict and ``context`` (see
    ``OffloadConfig.from_mindspore``, which builds the config from them)."""
    if offload_config is None:
        offload_config = {}
    if not isinstance(offload_config, Mapping):
        raise ConfigError(
            f"offload_config: expected a dict of MindSpore offload keys to values, got "
            f"{type(offload_config).__name__} {short_repr(offload_config)}"
        )
    offload_config = dict(offload_config)
    check_str_keys(offload_config, "offload_config")
    for key in offload_config:
        if key not in MINDSPORE_KEYS:
            raise ConfigError(
                f"offload_config key {short_repr(key)} is not a MindSpore offload key; "
                f"allowed: {', '.join(sorted(MINDSPORE_KEYS))}"
                f"{did_you_mean(key, MINDSPORE_KEYS)}"
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
    return values


def read_config_file(path: str | os.PathLike) -> tuple[dict[str, Any], str]:
    """The mapping at the top level of the JSON, YAML or TOML file ``path`` (string
    keys), and the file's name as messages quote it (see ``OffloadConfig.from_file``)."""
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
    check_str_keys(data, f"config file {name}")
    return data, name
