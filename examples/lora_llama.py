"""LoRA fine-tuning of a 1.1B-parameter Llama whose frozen base lives on disk.

A TinyLlama-1.1B-shaped model is built from a transformers config (no download; random
weights: the point is the memory and disk traffic, not the text), PEFT puts LoRA adapters
on its attention projections, and hetstore keeps the frozen base in bf16 on disk, the
adapters' fp32 master, gradients and AdamW states in host memory, under a device budget
far below the model. Per step the base is read from disk once for forward and once for
backward and never written: only the adapters' bf16 copies go back to disk.

    python examples/lora_llama.py                  # 1.1B: a few minutes on 2 CPU cores
    python examples/lora_llama.py --tiny           # seconds: checks the script

Prints each step's loss and time, the disk bytes read and written per step, and each
tier's peak. Needs transformers and peft (``pip install hetstore[hf]``).
"""

from __future__ import annotations

import argparse
import tempfile
import time

import torch

import hetstore
from hetstore._sizes import format_size

SHAPES = {
    # hidden, intermediate, layers, heads, kv heads, vocab (TinyLlama-1.1B)
    "1.1B": (2048, 5632, 22, 32, 4, 32000),
    "tiny": (64, 128, 2, 4, 2, 256),
}


def build(shape: str):
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaConfig, LlamaForCausalLM

    hidden, inter, layers, heads, kv, vocab = SHAPES[shape]
    config = LlamaConfig(
        hidden_size=hidden,
        intermediate_size=inter,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv,
        vocab_size=vocab,
        max_position_embeddings=2048,
    )
    torch.manual_seed(0)
    default = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)  # build the base in bf16: 2 bytes a parameter
    try:
        model = LlamaForCausalLM(config)
    finally:
        torch.set_default_dtype(default)
    lora = LoraConfig(r=16, lora_alpha=32, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"])
    return get_peft_model(model, lora), vocab


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tiny", action="store_true", help="a tiny model: checks the script")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--tokens", type=int, default=256, help="sequence length (batch 1)")
    parser.add_argument("--device-memory", default="1.5GB", help="max_device_memory")
    parser.add_argument("--offload-path", default=None, help="disk tier directory")
    args = parser.parse_args(argv)

    model, vocab = build("tiny" if args.tiny else "1.1B")
    total = sum(p.numel() for p in model.parameters())
    trainable = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(trainable, lr=1e-4, fused=True)
    with tempfile.TemporaryDirectory() as scratch:
        config = hetstore.OffloadConfig(
            offload_param="disk",  # the frozen base (and the adapters' bf16 copy)
            offload_optimizer="cpu",  # adapters' fp32 master + AdamW states
            offload_grad="cpu",  # so p.grad and torch's clipping work
            offload_activations="cpu",
            compute_dtype="bf16",
            max_device_memory=args.device_memory,
            offload_path=args.offload_path or scratch,
            enable_pinned_mem=False,
            device="cpu",
        )
        model, optimizer = hetstore.offload(model, optimizer, config)
        disk = hetstore.state_of(model).tiers.disk
        n_trainable = sum(p.numel() for p in trainable)
        print(
            f"Llama {total / 1e9:.2f}B parameters ({n_trainable / 1e6:.1f}M trainable LoRA), "
            f"base {format_size(2 * total)} bf16 on disk; device budget {args.device_memory}"
        )
        g = torch.Generator().manual_seed(0)
        print(f"{'step':>4} {'loss':>8} {'time s':>7} {'disk read':>10} {'disk written':>13}")
        for step in range(args.steps):
            ids = torch.randint(0, vocab, (1, args.tokens), generator=g)
            read, written, start = disk.bytes_read, disk.bytes_written, time.perf_counter()
            loss = model(input_ids=ids, labels=ids).loss
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            model.zero_grad()
            seconds = time.perf_counter() - start
            print(
                f"{step:>4} {loss.item():>8.4f} {seconds:>7.2f} "
                f"{format_size(disk.bytes_read - read):>10} "
                f"{format_size(disk.bytes_written - written):>13}"
            )
        stats = hetstore.memory_stats(model)
        print("peaks: " + ", ".join(f"{t} {format_size(s['peak'])}" for t, s in stats.items()))


if __name__ == "__main__":
    main()
