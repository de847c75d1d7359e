"""Checkpoints: the training state saved and restored across tiers, and weights exported.

``hetstore.save`` / ``hetstore.load`` (:mod:`.training`) on top of atomic, verified files
(:mod:`.files`) written as streamed safetensors (:mod:`.safetensors_stream`).
"""

from hetstore.checkpoint.files import CheckpointError, CheckpointReader, CheckpointWriter
from hetstore.checkpoint.training import load, save

__all__ = ["CheckpointError", "CheckpointReader", "CheckpointWriter", "save", "load"]
