"""The tests' GPT is the demo's: one model definition in the package."""

from hetstore.demo.gpt import GPT, Block, batches

__all__ = ["GPT", "Block", "batches"]
