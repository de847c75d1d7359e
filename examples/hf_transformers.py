"""Fine-tune a Hugging Face transformers causal LM with hetstore, and check that it trains
exactly like plain PyTorch.

The models are built from small configs with ``AutoModelForCausalLM.from_config`` (no
hub download, no tokenizer: the ids are the bytes of the text shipped with hetstore):
a Llama (rotary embeddings, grouped-query attention, untied head) and a GPT-2 (tied
embeddings). Each is trained twice on the same batches, called the HF way
(``model(input_ids=..., attention_mask=..., labels=...).loss``): once plain, once with
hetstore offloading its parameters and optimizer states (Llama: parameters in host
memory, optimizer states on disk; GPT-2: ``auto_offload`` under a device budget smaller
than its states). The losses must agree within a stated tolerance (fp32 on CPU).

    python examples/hf_transformers.py            # seconds to a minute
    python examples/hf_transformers.py --tiny     # seconds

Needs transformers (``pip install hetstore[hf]``).
"""

from __future__ import annotations

import argparse
import copy
import sys
import tempfile

import torch

import hetstore
from hetstore._sizes import format_size
from hetstore.demo import load_corpus

# fp32 on CPU: hetstore steps AdamW with torch's fused kernel over flat per-unit buffers
# (plain PyTorch here steps per parameter), which rounds differently in the last bits
TOLERANCE = 1e-4  # on each step's loss
WEIGHT_TOLERANCE = 1e-5  # on every trained weight at the end


def build(arch: str, width: int, depth: int, context: int):
    from transformers import AutoModelForCausalLM, GPT2Config, LlamaConfig

    if arch == "llama":
        config = LlamaConfig(
            vocab_size=256,
            hidden_size=width,
            intermediate_size=2 * width,
            num_hidden_layers=depth,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=context,
            tie_word_embeddings=False,
        )
    else:
        config = GPT2Config(
            vocab_size=256,
            n_embd=width,
            n_layer=depth,
            n_head=4,
            n_positions=context,
            # dropout off: the two copies must compute the same thing
            resid_pdrop=0.0,
            embd_pdrop=0.0,
            attn_pdrop=0.0,
            bos_token_id=0,  # GPT-2's 50256 is outside a byte vocabulary
            eos_token_id=0,
        )
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config, attn_implementation="sdpa")


def batches(data: torch.Tensor, n: int, batch: int, context: int):
    g = torch.Generator().manual_seed(0)
    for _ in range(n):
        starts = torch.randint(0, data.numel() - context, (batch,), generator=g).tolist()
        ids = torch.stack([data[s : s + context] for s in starts])
        # the model shifts labels itself; the mask is all ones (no padding here)
        yield ids, torch.ones_like(ids)


def train(model, optimizer, data, args, device) -> list[float]:
    losses = []
    for ids, mask in batches(data, args.steps, args.batch, args.context):
        ids, mask = ids.to(device), mask.to(device)
        loss = model(input_ids=ids, attention_mask=mask, labels=ids).loss
        loss.backward()
        if hasattr(optimizer, "clip_grad_norm_"):
            optimizer.clip_grad_norm_(1.0)
        else:
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses


def adamw(params):
    return torch.optim.AdamW(params, lr=1e-3, weight_decay=0.01)


def compare(arch: str, data: torch.Tensor, args, offload_path: str) -> bool:
    model = build(arch, args.width, args.depth, args.context)
    reference = copy.deepcopy(model)
    n_params = sum(p.numel() for p in model.parameters())
    states = 16 * n_params  # fp32 param, grad, two AdamW moments
    print(f"== {type(model).__name__}: {n_params:,} parameters, states {format_size(states)}")
    example = next(batches(data, 1, args.batch, args.context))[0]
    if arch == "llama":
        config = hetstore.OffloadConfig(
            offload_param="cpu",
            offload_optimizer="disk",
            offload_path=offload_path,
            enable_pinned_mem=torch.cuda.is_available(),
        )
        model, optimizer = hetstore.offload(model, adamw(model.parameters()), config)
        budget = None
    else:
        budget = states // 2
        config = hetstore.OffloadConfig(
            auto_offload=True,
            max_device_memory=budget,
            activation_min_bytes="4KB",
            offload_path=offload_path,
            enable_pinned_mem=torch.cuda.is_available(),
        )
        model, optimizer = hetstore.offload(
            model, adamw(model.parameters()), config, example_inputs=(example,)
        )
    runtime = hetstore.state_of(model).runtime
    print(f"units: {', '.join(u.name for u in runtime.units)}")
    print(f"plan:\n{runtime.plan}")
    device = config.resolved_device()
    losses = train(model, optimizer, data, args, device)
    ref_losses = train(reference.to(device), adamw(reference.parameters()), data, args, device)
    diff = max(abs(a - b) for a, b in zip(losses, ref_losses, strict=True))
    for step, (a, b) in enumerate(zip(losses, ref_losses, strict=True)):
        print(f"step {step}: hetstore loss {a:.6f}  plain PyTorch loss {b:.6f}")
    same = diff <= TOLERANCE
    print(
        f"max |loss difference| {diff:.2e} over {len(losses)} steps: "
        f"{'match' if same else 'MISMATCH'} (tolerance {TOLERANCE:g})"
    )
    # state_dict() gathers the weights from wherever they live, under the original keys
    mine, theirs = model.state_dict(), reference.state_dict()
    same_keys = list(mine) == list(theirs)
    weight_diff = max((mine[k].cpu() - theirs[k].cpu()).abs().max().item() for k in theirs)
    same_weights = same_keys and weight_diff <= WEIGHT_TOLERANCE
    print(
        f"state_dict: {'same' if same_keys else 'DIFFERENT'} keys as plain PyTorch; "
        f"max |weight difference| {weight_diff:.2e}: "
        f"{'match' if same_weights else 'MISMATCH'} (tolerance {WEIGHT_TOLERANCE:g})"
    )
    ok = same and same_weights and losses[-1] < losses[0]
    if budget is not None:
        peak = hetstore.memory_stats(model)["device"]["peak"]
        within = peak <= budget
        print(
            f"device peak {peak:,} bytes of budget {budget:,} bytes "
            f"({'within budget' if within else 'OVER BUDGET'})"
        )
        ok = ok and within
    print()
    return ok


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--arch", choices=["llama", "gpt2", "both"], default="both")
    parser.add_argument("--width", type=int, default=128)
    parser.add_argument("--depth", type=int, default=4)
    parser.add_argument("--context", type=int, default=64)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--tiny", action="store_true", help="a seconds-long run")
    args = parser.parse_args()
    if args.tiny:
        args.width, args.depth, args.context, args.batch, args.steps = 32, 2, 16, 4, 4
    try:
        import transformers
    except ImportError:
        print("this example needs transformers: pip install hetstore[hf]")
        return 0
    transformers.logging.set_verbosity_error()  # its config notices are not the point here
    print(f"transformers {transformers.__version__}, torch {torch.__version__}\n")
    data = load_corpus()
    archs = ["llama", "gpt2"] if args.arch == "both" else [args.arch]
    with tempfile.TemporaryDirectory() as offload_path:
        results = [compare(arch, data, args, offload_path) for arch in archs]
    return 0 if all(results) else 1


if __name__ == "__main__":
    sys.exit(main())
