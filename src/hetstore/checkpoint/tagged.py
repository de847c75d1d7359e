"""Python values (scheduler states, RNG states, param groups) as JSON plus tensors, no pickle.

``torch.save`` pickles, and unpickling an untrusted file runs its code. What a training
loop wants to checkpoint besides weights is small and made of a few types, so it is
stored as JSON with tags for what JSON lacks, and its tensors in a safetensors file:

- ``{"__tensor__": key}``: a tensor (its dtype and shape are the safetensors file's),
- ``{"__ndarray__": key}``: a numpy array (numpy's RNG state), stored as a tensor,
- ``{"__tuple__": [...]}``: a tuple (``random.getstate()`` is nested tuples),
- ``{"__dict__": [[key, value], ...]}``: a dict whose keys are not all strings,
- ``{"__float__": "inf" | "-inf" | "nan"}``: a float JSON cannot write.

Anything else (a lambda, a custom object) is refused when saving, with its path in the
value, so a checkpoint never silently drops part of what the user asked to keep.
"""

from __future__ import annotations

import math

import numpy as np
import torch

from hetstore.checkpoint.safetensors_stream import DTYPE_NAMES

__all__ = ["encode", "decode"]

_TAGS = ("__tensor__", "__ndarray__", "__tuple__", "__dict__", "__float__")
_ALLOWED = "tensors, numpy arrays, numbers, strings, booleans, None, lists, tuples and dicts"


def encode(value, tensors: dict[str, torch.Tensor], path: str = "extra"):
    """``value`` as JSON-able data; its tensors are added to ``tensors`` under new keys."""
    if isinstance(value, (torch.Tensor, np.ndarray)):
        tag = "__tensor__" if isinstance(value, torch.Tensor) else "__ndarray__"
        tensor = value if tag == "__tensor__" else torch.from_numpy(np.ascontiguousarray(value))
        if tensor.dtype not in DTYPE_NAMES:
            raise TypeError(
                f"{path} is a tensor of dtype {tensor.dtype}, which safetensors cannot store"
            )
        key = f"t{len(tensors)}"
        tensors[key] = tensor.detach().to("cpu").contiguous().clone()
        return {tag: key}
    if value is None or isinstance(value, (bool, int, str)):
        return value
    if isinstance(value, float):
        return value if math.isfinite(value) else {"__float__": repr(value)}
    if isinstance(value, (np.integer, np.floating, np.bool_)):
        return encode(value.item(), tensors, path)
    if isinstance(value, tuple):
        return {"__tuple__": [encode(v, tensors, f"{path}[{i}]") for i, v in enumerate(value)]}
    if isinstance(value, list):
        return [encode(v, tensors, f"{path}[{i}]") for i, v in enumerate(value)]
    if isinstance(value, dict):
        if all(isinstance(k, str) for k in value) and not any(k in _TAGS for k in value):
            return {k: encode(v, tensors, f"{path}[{k!r}]") for k, v in value.items()}
        pairs = []
        for k, v in value.items():
            if not isinstance(k, (str, int, float, bool, tuple)) and k is not None:
                raise TypeError(
                    f"{path} has a key of type {type(k).__name__}; checkpoint dict keys may "
                    "be strings, numbers, booleans, None or tuples"
                )
            pairs.append([encode(k, tensors, path), encode(v, tensors, f"{path}[{k!r}]")])
        return {"__dict__": pairs}
    raise TypeError(
        f"{path} is a {type(value).__module__}.{type(value).__qualname__}; a checkpoint "
        f"stores {_ALLOWED} (no pickle, so nothing executable is ever loaded)"
    )


def decode(data, tensors: dict[str, torch.Tensor], path: str = "extra"):
    """The value :func:`encode` turned into ``data``, checked on the way: a tag must be
    its dict's only key and hold what :func:`encode` puts there, a tensor key must be
    in ``tensors``, a dict key must be hashable. Anything else raises ``ValueError``
    naming the place (``path``) in the value, so a crafted file cannot half-decode."""
    if isinstance(data, list):
        return [decode(v, tensors, f"{path}[{i}]") for i, v in enumerate(data)]
    if data is None or isinstance(data, (bool, int, float, str)):
        return data
    if not isinstance(data, dict):
        raise ValueError(f"{path}: a {type(data).__name__} is not a stored value")
    tags = [k for k in data if k in _TAGS]
    if not tags:
        return {k: decode(v, tensors, f"{path}[{k!r}]") for k, v in data.items()}
    tag = tags[0]
    if len(data) != 1:
        raise ValueError(
            f"{path}: the tag {tag!r} must be alone in its object, found {sorted(data)}"
        )
    value = data[tag]
    if tag in ("__tensor__", "__ndarray__"):
        if not isinstance(value, str) or value not in tensors:
            raise ValueError(f"{path}: tensor {value!r} is not in the tensor file")
        if tag == "__tensor__":
            return tensors[value]
        try:
            return tensors[value].numpy()
        except (TypeError, RuntimeError) as exc:
            raise ValueError(f"{path}: tensor {value!r} cannot be a numpy array: {exc}") from None
    if tag == "__float__":
        if value not in ("inf", "-inf", "nan"):
            raise ValueError(f"{path}: __float__ holds {value!r}, not 'inf', '-inf' or 'nan'")
        return float(value)
    if not isinstance(value, list):
        raise ValueError(f"{path}: {tag} holds a {type(value).__name__}, not a list")
    if tag == "__tuple__":
        return tuple(decode(v, tensors, f"{path}[{i}]") for i, v in enumerate(value))
    out = {}
    for i, pair in enumerate(value):
        if not isinstance(pair, list) or len(pair) != 2:
            raise ValueError(f"{path}: __dict__ item {i} is not a [key, value] pair")
        key = _hashable(decode(pair[0], tensors, f"{path} key {i}"))
        if not _is_key(key):
            raise ValueError(f"{path}: __dict__ key {i} is not a string, number, None or tuple")
        out[key] = decode(pair[1], tensors, f"{path}[{key!r}]")
    return out


def _hashable(key):
    return tuple(_hashable(k) for k in key) if isinstance(key, (list, tuple)) else key


def _is_key(key) -> bool:
    if isinstance(key, tuple):
        return all(_is_key(k) for k in key)
    return key is None or isinstance(key, (str, int, float, bool))
