"""Colocated RL: a GRPO-shaped loop where the trainer gives its device memory to the
rollout engine between steps.

RL post-training alternates two phases on the same device: rollout, where an inference
engine (vLLM, SGLang) needs the memory, and training. Each step here:

1. **sync**: the new weights go to the engine, unit by unit, with
   ``hetstore.named_weights(model)`` (what an engine's ``load_weights(iterable)`` takes);
2. **evict**: ``hetstore.evict(model, optimizer)`` moves every byte the trainer holds on
   the device to host memory; the device tier then holds zero bytes;
3. **rollout**: the engine (here a plain PyTorch copy of the policy, the stand-in for
   vLLM) samples a group of completions per prompt;
4. **restore**: ``hetstore.restore(model, optimizer)`` brings the trainer back;
5. **train**: rewards, group-normalised advantages (GRPO) and a policy-gradient loss;
   one optimizer step.

The policy is a small transformers Llama built from a config (no download; random
weights): its parameters live on the device in bf16, the fp32 master and AdamW states
in host memory. The reward is a toy one (how many sampled tokens fall in the lower half
of the vocabulary), so the mean reward rises as it learns.

    python examples/rl_colocate.py                 # ~50M Llama, a minute on 2 CPU cores
    python examples/rl_colocate.py --tiny --check  # seconds; --check reruns without the
                                                   # evict/restore cycles: same losses

Prints each phase's time and bytes per step. Needs transformers (``pip install
hetstore[hf]``).
"""

from __future__ import annotations

import argparse
import copy
import time

import torch

import hetstore
from hetstore._sizes import format_size

SHAPES = {  # hidden, intermediate, layers, heads, vocab
    "50M": (512, 1376, 8, 8, 8192),
    "tiny": (64, 128, 2, 4, 256),
}


def build(shape: str):
    from transformers import LlamaConfig, LlamaForCausalLM

    hidden, inter, layers, heads, vocab = SHAPES[shape]
    config = LlamaConfig(
        hidden_size=hidden,
        intermediate_size=inter,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=heads,
        vocab_size=vocab,
        max_position_embeddings=256,
    )
    torch.manual_seed(0)
    return LlamaForCausalLM(config), vocab


def load_weights(engine: torch.nn.Module, weights) -> int:
    """What an inference engine's ``load_weights`` does: copy each named tensor in."""
    params = dict(engine.named_parameters())
    params.update(engine.named_buffers())
    nbytes = 0
    with torch.no_grad():
        for name, tensor in weights:
            params[name].copy_(tensor)
            nbytes += tensor.numel() * tensor.element_size()
    return nbytes


@torch.no_grad()
def rollout(engine, prompts: torch.Tensor, group: int, new_tokens: int, g: torch.Generator):
    """``group`` sampled completions per prompt (no KV cache: the stand-in keeps it short)."""
    ids = prompts.repeat_interleave(group, dim=0)
    for _ in range(new_tokens):
        logits = engine(input_ids=ids).logits[:, -1].float()
        ids = torch.cat([ids, torch.multinomial(logits.softmax(-1), 1, generator=g)], dim=1)
    return ids


def grpo_loss(model, ids: torch.Tensor, prompt_len: int, rewards: torch.Tensor, group: int):
    """Group-relative advantages times the completions' log-probabilities."""
    by_group = rewards.view(-1, group)
    advantages = (by_group - by_group.mean(1, keepdim=True)) / (
        by_group.std(1, keepdim=True) + 1e-4
    )
    logits = model(input_ids=ids[:, :-1]).logits.float()
    logp = torch.log_softmax(logits, -1).gather(-1, ids[:, 1:, None]).squeeze(-1)
    completion = logp[:, prompt_len - 1 :].sum(1)
    return -(advantages.view(-1) * completion).mean()


def train(args, cycles: bool) -> list[float]:
    model, vocab = build("tiny" if args.tiny else "50M")
    engine = copy.deepcopy(model).to(torch.bfloat16).eval()  # the rollout engine's copy
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, fused=True)
    config = hetstore.OffloadConfig(
        offload_param="none",  # the bf16 parameters stay on the device between steps
        offload_optimizer="cpu",  # the fp32 master and AdamW states in host memory
        compute_dtype="bf16",
        enable_pinned_mem=False,
        device="cpu",
    )
    model, optimizer = hetstore.offload(model, optimizer, config)
    total = sum(p.numel() for p in model.parameters())
    if cycles:
        print(
            f"Llama {total / 1e6:.1f}M parameters; {args.prompts} prompts x {args.group} samples "
            f"x {args.new_tokens} tokens per step"
        )
        print(
            f"{'step':>4} {'reward':>7} {'loss':>8} | {'sync':>16} | {'evict':>18} | "
            f"{'rollout':>8} | {'restore':>18} | {'train':>7}"
        )
    g = torch.Generator().manual_seed(1)
    losses = []
    for step in range(args.steps):
        t0 = time.perf_counter()
        synced = load_weights(engine, hetstore.named_weights(model, torch.bfloat16))
        t_sync = time.perf_counter() - t0
        if cycles:
            held = hetstore.memory_stats(model)["device"]["current"]
            out = hetstore.evict(model, optimizer)
            assert hetstore.memory_stats(model)["device"]["current"] == 0
        t0 = time.perf_counter()
        prompts = torch.randint(0, vocab, (args.prompts, args.prompt_len), generator=g)
        ids = rollout(engine, prompts, args.group, args.new_tokens, g)
        t_rollout = time.perf_counter() - t0
        if cycles:
            back = hetstore.restore(model, optimizer)
            assert hetstore.memory_stats(model)["device"]["current"] == held
        t0 = time.perf_counter()
        rewards = (ids[:, args.prompt_len :] < vocab // 2).float().mean(1)
        loss = grpo_loss(model, ids, args.prompt_len, rewards, args.group)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad()
        t_train = time.perf_counter() - t0
        losses.append(loss.item())
        if cycles:
            print(
                f"{step:>4} {rewards.mean().item():>7.3f} {loss.item():>8.4f} | "
                f"{format_size(synced):>8} {t_sync * 1e3:>5.0f} ms | "
                f"{format_size(out.total):>9} {out.seconds * 1e3:>5.1f} ms | "
                f"{t_rollout:>6.2f} s | "
                f"{format_size(back.total):>9} {back.seconds * 1e3:>5.1f} ms | "
                f"{t_train:>5.2f} s"
            )
    hetstore.release(model)
    return losses


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tiny", action="store_true", help="a tiny model: checks the script")
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--group", type=int, default=4, help="completions per prompt")
    parser.add_argument("--prompt-len", type=int, default=8)
    parser.add_argument("--new-tokens", type=int, default=16)
    parser.add_argument("--lr", type=float, default=1e-4)
    parser.add_argument(
        "--check", action="store_true", help="rerun without evict/restore: the same losses"
    )
    args = parser.parse_args(argv)
    losses = train(args, cycles=True)
    if args.check:
        again = train(args, cycles=False)
        same = again == losses
        print(f"without the evict/restore cycles: {'the same losses, bitwise' if same else again}")
        if not same:
            raise SystemExit("the cycles changed the training")


if __name__ == "__main__":
    main()
