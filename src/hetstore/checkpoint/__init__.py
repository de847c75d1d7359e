"""Checkpoints: the training state saved and restored across tiers, and weights exported.

``hetstore.save`` / ``hetstore.load`` (:mod:`.training`) and ``hetstore.export_weights`` (:mod:`.export`) on top of atomic, verified files
(:mod:`.files`) written as streamed safetensors (:mod:`.safetensors_stream`).
"""

from hetstore.checkpoint.export import export_weights
from hetstore.checkpoint.files import CheckpointError, CheckpointReader, CheckpointWriter
from hetstore.checkpoint.training import load, save

__all__ = [
    "CheckpointError",
    "CheckpointReader",
    "CheckpointWriter",
    "save",
    "load",
    "export_weights",
]
