"""Small Hugging Face transformers models (configs and their build on one seed), shared by
the tests that drive transformers (moved here from test_hf_models, unchanged). Importing
this module skips the importing test module where transformers is not installed."""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")


def llama(tie: bool = False):
    return transformers.LlamaConfig(
        vocab_size=256,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=32,
        tie_word_embeddings=tie,
    )


def gpt2(tie: bool = True):
    return transformers.GPT2Config(
        vocab_size=256,
        n_embd=32,
        n_layer=2,
        n_head=4,
        n_positions=32,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        tie_word_embeddings=tie,
    )


def build(config):
    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(config, attn_implementation="sdpa")
