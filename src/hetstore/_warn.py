"""Warnings that point at the user's line.

``warnings.warn(..., stacklevel=N)`` needs the depth of the call chain between the
warning and the user's code, which moves whenever hetstore's internals do (the
pinned-memory warning, at a fixed depth, pointed at ``api.py``). Here the depth is
counted instead: the first frame outside hetstore's package, torch (whose hooks call
hetstore inside a forward or a backward) and ``contextlib`` (``with
hetstore.offloaded(...)``) is the user's.
"""

from __future__ import annotations

import contextlib
import os
import sys
import warnings

import torch

__all__ = ["warn_at_caller"]

_SKIPPED = tuple(
    os.path.dirname(os.path.abspath(module.__file__)) + os.sep
    for module in (sys.modules[__name__.rpartition(".")[0]], torch)
) + (os.path.abspath(contextlib.__file__),)


def warn_at_caller(message: str, category: type[Warning]) -> None:
    """``warnings.warn(message, category)`` reported at the first frame outside hetstore
    (see module doc); at the outermost frame when there is none (a thread of hetstore's
    own)."""
    frame = sys._getframe(1)
    level = 2  # stacklevel 2: the frame that called this function
    while frame is not None and frame.f_code.co_filename.startswith(_SKIPPED):
        frame = frame.f_back
        level += 1
    if frame is None:
        level -= 1  # all hetstore and torch: the outermost of them
    warnings.warn(message, category, stacklevel=level)
