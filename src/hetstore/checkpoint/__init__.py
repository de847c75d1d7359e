"""Checkpoints of offloaded training state (issue 9; the file layer first)."""

from hetstore.checkpoint.files import CheckpointError, CheckpointReader, CheckpointWriter

__all__ = ["CheckpointError", "CheckpointReader", "CheckpointWriter"]
