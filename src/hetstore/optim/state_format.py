"""How optimizer states are stored: fp32 (exact), bf16, or 8-bit block-wise.

``OffloadConfig.optimizer_state_format`` picks one for every per-element state of the
flat optimizers (Adam's moments, SGD's momentum). The fp32 master weights are kept
whatever the format: only the states are compact. The step decodes a chunk of states
into fp32 scratch, runs torch's fused kernel on it exactly as for fp32 states, and
encodes the result back, so the arithmetic of the update itself is torch's.

- ``"fp32"``: the states as torch keeps them; 4 bytes per element; bitwise plain PyTorch.
- ``"bf16"``: each state rounded to bfloat16 (round to nearest even); 2 bytes.
- ``"8bit"``: blocks of :data:`BLOCK` elements, each with an fp32 scale (the block's
  largest magnitude) and one byte per element: a float8 e4m3 (torch's
  ``float8_e4m3fn``: 3 mantissa bits, so within 1/16 of the value) of the element times
  ``2^8 / scale``, rounded to nearest even. A second moment is stored as its square root
  and never below e4m3's smallest step, so a denominator is never rounded down to zero
  (a zero ``v`` under a nonzero first moment is what makes 8-bit Adam diverge).
  1 + 4/256 bytes per element.

Why our own 8-bit code and not a library's: measured on this machine (2 cores, 4M
elements, one state), bitsandbytes 0.50's CPU block-wise kernels take 15.5 ms to quantize
and 28.6 ms to dequantize, torchao 0.18's 8-bit quantizer 350 ms eagerly (it relies on
``torch.compile``, which needs a C++ toolchain and minutes of compiling on 2 cores);
the code here takes about 7 ms each way. Encoding is a multiplication by the block's
reciprocal and torch's cast, decoding a table look-up and a multiplication: every step
is correctly rounded elementwise arithmetic (no ``log2``/``exp2``, whose vectorised and
scalar paths differ in the last bit), so a chunk's codes do not depend on how the work
is split into chunks or threads: the same states come out whatever the chunk size, tier
or thread count, and a checkpoint resumes bitwise. It is plain torch, so it runs on CUDA
as it is.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from hetstore.config import STATE_FORMATS as FORMATS

__all__ = [
    "BLOCK",
    "FORMATS",
    "StateFormat",
    "state_format",
    "stored_arrays",
    "blocks",
    "covering",
    "scales_of",
    "decode",
    "encode",
]

BLOCK = 256  # elements per 8-bit scale; every chunk of a step starts at a multiple of it

CODE_DTYPE = torch.float8_e4m3fn  # 1 sign, 4 exponent, 3 mantissa bits; exact up to 448
# values are stored as value * (2^8 / block scale): the largest element of a block lands
# on 256 (exact in e4m3), far below e4m3's largest (448), so nothing saturates
_HEADROOM = 2.0**8
# a second moment's root never rounds to zero: at least e4m3's smallest step (2^-9)
_SMALLEST = 2.0**-9
# the 256 codes' values, to decode by table look-up (exact; a cast from float8 to fp32
# runs at a quarter of the speed on CPU)
_TABLE = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(CODE_DTYPE).float()
_TABLE = torch.nan_to_num(_TABLE, nan=0.0)  # the two NaN codes are never written


@dataclass(frozen=True)
class StateFormat:
    """One storage format of per-element optimizer states."""

    name: str

    @property
    def exact(self) -> bool:
        return self.name == "fp32"

    def bytes_per_element(self) -> float:
        return {"fp32": 4.0, "bf16": 2.0, "8bit": 1.0 + 4.0 / BLOCK}[self.name]


def state_format(name: str) -> StateFormat:
    if name not in FORMATS:
        raise ValueError(f"unknown optimizer state format {name!r}; allowed: {FORMATS}")
    return StateFormat(name)


def _unsigned(key: str) -> bool:
    """Second moments: stored as square roots, never rounded to zero."""
    return key.endswith("exp_avg_sq")


def blocks(numel: int) -> int:
    return -(-numel // BLOCK)


def covering(start: int, numel: int, total: int) -> tuple[int, int]:
    """The element range of whole blocks (the last may be short at ``total``) that
    covers elements ``[start, start + numel)`` of an array of ``total``."""
    return start // BLOCK * BLOCK, min(total, blocks(start + numel) * BLOCK)


def scales_of(scales: torch.Tensor | None, start: int, numel: int) -> torch.Tensor | None:
    """The scales of elements ``[start, start + numel)`` (``start`` a block boundary) out
    of a whole array's ``scales`` (None in the formats without scales)."""
    return None if scales is None else scales[start // BLOCK : blocks(start + numel)]


def stored_arrays(fmt: StateFormat, numel: int) -> dict[str, tuple[torch.dtype, int]]:
    """The arrays one state of ``numel`` elements is stored in: suffix -> (dtype, numel).
    The suffix "" is the per-element array; "scales" the 8-bit format's block scales."""
    if fmt.name == "fp32":
        return {"": (torch.float32, numel)}
    if fmt.name == "bf16":
        return {"": (torch.bfloat16, numel)}
    return {"": (CODE_DTYPE, numel), "scales": (torch.float32, blocks(numel))}


@torch.no_grad()
def decode(fmt: StateFormat, key: str, codes: torch.Tensor, scales, out: torch.Tensor) -> None:
    """``out`` (fp32, the length of ``codes``) = the values stored in ``codes`` (and, for
    8-bit, ``scales``: one per :data:`BLOCK` elements of ``codes``, which starts at a
    block boundary)."""
    if fmt.name != "8bit":
        out.copy_(codes)
        return
    n = codes.numel()
    table = _TABLE if _TABLE.device == out.device else _TABLE.to(out.device)
    index = codes.view(torch.uint8).to(torch.int32)
    torch.index_select(table, 0, index, out=out)
    _per_block(out, scales / _HEADROOM, n, torch.Tensor.mul_)
    if _unsigned(key):
        out.square_()  # stored as sqrt(v)


def _per_block(values: torch.Tensor, per_block: torch.Tensor, n: int, op) -> None:
    """``op(values_block, per_block[block])`` for every block (the last may be short)."""
    full = n // BLOCK * BLOCK
    if full:
        op(values[:full].view(-1, BLOCK), per_block[: full // BLOCK, None])
    if full < n:
        op(values[full:], per_block[full // BLOCK])


def _block_amax(values: torch.Tensor, n: int) -> torch.Tensor:
    """Each block's largest magnitude, in one pass and without a copy of ``values``."""

    def amax(x: torch.Tensor, **dim) -> torch.Tensor:
        low, high = torch.aminmax(x, **dim)
        return torch.maximum(high, low.neg_())

    full = n // BLOCK * BLOCK
    parts = []
    if full:
        parts.append(amax(values[:full].view(-1, BLOCK), dim=1))
    if full < n:
        parts.append(amax(values[full:]).reshape(1))
    return torch.cat(parts) if len(parts) > 1 else parts[0]


@torch.no_grad()
def encode(fmt: StateFormat, key: str, values: torch.Tensor, codes: torch.Tensor, scales) -> None:
    """Store fp32 ``values`` into ``codes`` (and ``scales``), the inverse of
    :func:`decode` up to the format's rounding (to nearest, ties to even). ``values``
    is scratch: the 8-bit format overwrites it."""
    if fmt.name != "8bit":
        codes.copy_(values)
        return
    n = values.numel()
    if _unsigned(key):
        values.clamp_(min=0).sqrt_()
    amax = _block_amax(values, n)
    scales.copy_(amax)
    # multiplied by the reciprocal (a division per element is 20x slower on CPU)
    inverse = torch.where(amax > 0, _HEADROOM / amax, torch.zeros_like(amax))
    _per_block(values, inverse, n, torch.Tensor.mul_)
    if _unsigned(key):
        values.clamp_(min=_SMALLEST)
    codes.copy_(values)
