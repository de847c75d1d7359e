"""The storage protocol: what the runtime may do with a flat buffer on any tier.

A unit keeps each form of its parameters (fp32 master, compute-dtype home, gradients,
optimizer states) as one flat buffer on the tier the plan chose. Two kinds of tier
exist, told apart by one capability, never by a buffer's type:

- **addressable** tiers (device and host memory) hand out a ``torch.Tensor``: the
  runtime views, slices and steps it in place, and a copy is ``copy_``;
- the others (disk today; GPU-direct storage or an object store would be the same kind)
  hand out a :class:`Store`: elements move only through :meth:`Store.read` /
  :meth:`Store.write` into host buffers, asynchronously, and a change that must not be
  left half-done is written into a :meth:`Store.shadow` and made current with
  :meth:`Store.commit` (or thrown away with :meth:`Store.discard`).

``addressable(buffer)`` (or its complement ``transfers_only``) is the one question code
outside :mod:`hetstore.tiers` asks;
``read_into`` / ``write_from`` copy either kind synchronously. A new tier of the first
kind returns tensors from its ``allocate_flat``; one of the second kind returns objects
that implement :class:`Store` (see docs/how-it-works.md, "Where a new piece plugs in").
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol, runtime_checkable

import torch

__all__ = [
    "Done",
    "FlatBuffer",
    "Store",
    "Transfer",
    "addressable",
    "transfers_only",
    "read_into",
    "wait_all",
    "wait_all_quiet",
    "write_from",
]


class Transfer(Protocol):
    """An asynchronous read or write under way."""

    def wait(self, timeout: float | None = None) -> None: ...

    def done(self) -> bool: ...


@runtime_checkable
class Store(Protocol):
    """A flat array of ``numel`` elements of ``dtype`` on a tier that is not addressable.

    Reads see the last write (a read waits for the array's writes). An array never
    written reads as zeros. ``before_read``, when set, runs before every read: the step
    engine uses it to land a step that replaces the contents before anyone reads them.
    """

    numel: int
    dtype: torch.dtype
    label: str
    written: bool
    before_read: Callable[[], None] | None

    @property
    def nbytes(self) -> int: ...

    @property
    def reserved_bytes(self) -> int:
        """What one more array of this size takes of the tier's capacity: the room a
        shadow needs."""
        ...

    def read(self, buffer: torch.Tensor, start: int = 0) -> Transfer: ...

    def write(
        self, buffer: torch.Tensor, start: int = 0, *, into: Store | None = None
    ) -> Transfer: ...

    def write_all(self, buffer: torch.Tensor) -> None: ...

    def wait_writes(self) -> None: ...

    def shadow(self) -> Store: ...

    def commit(self, shadow: Store) -> None: ...

    def discard(self) -> None: ...

    def free(self) -> None: ...


# One flat form of a unit on any tier: a tensor on an addressable tier, else a Store.
FlatBuffer = torch.Tensor | Store


def addressable(buffer: FlatBuffer | None) -> bool:
    """Whether ``buffer`` is memory the runtime can view and change in place (a tensor
    on the device or the host), as opposed to a :class:`Store` reached by transfers."""
    return isinstance(buffer, torch.Tensor)


def transfers_only(buffer: FlatBuffer | None) -> bool:
    """Whether ``buffer`` is a :class:`Store`, reached only by transfers (False for a
    tensor and for ``None``, a buffer not made)."""
    return buffer is not None and not addressable(buffer)


class Done:
    """A finished transfer (zero-filled reads of never-written arrays)."""

    def wait(self, timeout: float | None = None) -> None:
        return None

    def done(self) -> bool:
        return True


def wait_all(handles: list) -> None:
    """Wait for every handle, then raise the first error (no transfer is left running)."""
    first: BaseException | None = None
    for handle in handles:
        try:
            handle.wait()
        except BaseException as exc:  # noqa: BLE001 - collected, re-raised below
            first = first or exc
    handles.clear()
    if first is not None:
        raise first


def wait_all_quiet(handles: list) -> None:
    """Wait for every handle, ignoring errors (cleanup after another error)."""
    for handle in handles:
        try:
            handle.wait()
        except BaseException:  # noqa: BLE001 - an error is already being raised
            pass
    handles.clear()


def read_into(source: FlatBuffer, dst: torch.Tensor, start: int = 0) -> None:
    """Copy elements ``[start, start + dst.numel())`` of ``source`` into ``dst`` (cast to
    its dtype in memory; a store's read needs ``dst`` in the array's dtype) and wait."""
    if addressable(source):
        dst.copy_(source[start : start + dst.numel()])
    else:
        source.read(dst, start).wait()


def write_from(target: FlatBuffer, src: torch.Tensor, start: int = 0) -> None:
    """Write ``src`` into elements ``[start, start + src.numel())`` of ``target`` and
    wait until it is there."""
    if addressable(target):
        target[start : start + src.numel()].copy_(src)
    else:
        target.write(src, start)
        target.wait_writes()
