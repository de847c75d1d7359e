"""The largest-model run's code path against plain PyTorch, on a slice of it that fits.

    .venv/bin/python benchmarks/largest_model_parity.py --layers 2            # full width
    .venv/bin/python benchmarks/largest_model_parity.py --hidden 256 --layers 56

``largest_model.py`` has no plain-PyTorch reference: the model does not fit in RAM. This
trains the same Hugging Face config (default ``benchmarks/configs/llama7b.json``),
narrowed (``--hidden``, the MLP scaled with it) or shortened (``--layers``) until plain
PyTorch fits, from the same init and batch, in one process: plain AdamW, then hetstore
with the largest run's path (everything on disk, ``optimizer_state_format``,
``step_in_backward``, fused AdamW at the same lr). Prints both loss sequences. With
fp32 states they are bitwise equal; with 8-bit states the first steps agree to many
decimals (Adam's first step is lr x sign(gradient) whatever the moments' rounding).
"""

from __future__ import annotations

import argparse
import json
import shutil
import tempfile
from pathlib import Path

import torch

import hetstore
from _common import machine_line
from hetstore.cli_plan import _hf_model
from hetstore.demo import load_corpus
from largest_model import LR

REPO = Path(__file__).resolve().parent.parent


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hf-config", default=str(REPO / "benchmarks/configs/llama7b.json"))
    parser.add_argument("--hidden", type=int, help="narrow the model to this hidden size")
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--ctx", type=int, default=64)
    parser.add_argument("--state-format", default="8bit", choices=["fp32", "bf16", "8bit"])
    parser.add_argument("--dir", default=str(REPO / "offload"))
    args = parser.parse_args()

    values = json.loads(Path(args.hf_config).read_text())
    if args.hidden:
        ratio = args.hidden / values["hidden_size"]
        heads = max(1, args.hidden // values.get("head_dim", 128))
        values.update(
            hidden_size=args.hidden,
            intermediate_size=int(values["intermediate_size"] * ratio),
            num_attention_heads=heads,
            num_key_value_heads=heads,
        )
    Path(args.dir).mkdir(parents=True, exist_ok=True)
    work = tempfile.mkdtemp(prefix="parity-", dir=args.dir)
    config_path = Path(work) / "config.json"
    config_path.write_text(json.dumps(values))

    def build():
        model = _hf_model(str(config_path), args.layers).to_empty(device="cpu")
        torch.manual_seed(1)
        model.apply(model._init_weights)
        return model

    data = load_corpus()
    torch.manual_seed(0)
    start = int(torch.randint(0, data.numel() - args.ctx - 1, (1,)))
    x = data[start : start + args.ctx].unsqueeze(0)
    print(machine_line())
    largest_run_path = hetstore.OffloadConfig(
        offload_param="disk",
        offload_optimizer="disk",
        optimizer_state_format=args.state_format,
        step_in_backward=True,
        offload_path=str(Path(work) / "offload"),
        device="cpu",
        enable_pinned_mem=False,
        compute_dtype="fp32",
    )
    runs = {"plain PyTorch": None, f"hetstore ({args.state_format}, all on disk)": largest_run_path}
    results = {}
    for name, config in runs.items():
        model = build()
        optimizer = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.1, fused=True)
        if config is not None:
            model, optimizer = hetstore.offload(model, optimizer, config)
        losses = []
        for _ in range(args.steps):
            loss = model(input_ids=x, labels=x).loss
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            losses.append(loss.item())
        if config is not None:
            hetstore.release(model)
        del model, optimizer
        results[name] = losses
        print(f"{name:36s} " + " -> ".join(f"{v:.4f}" for v in losses), flush=True)
    shutil.rmtree(work, ignore_errors=True)
    plain, offloaded = results.values()
    gap = max(abs(a - b) for a, b in zip(plain, offloaded, strict=True))
    print(f"largest difference: {gap:.2e}")


if __name__ == "__main__":
    main()
