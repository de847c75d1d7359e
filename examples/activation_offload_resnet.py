"""The MindSpore seed's case: a ResNet whose *activations* at a large batch do not fit the
device budget. Without offload it stops with OutOfDeviceMemory and the statistics; with
``offload_activations="cpu"`` the same run trains and prints the loss per step.

    python examples/activation_offload_resnet.py            # default size
    python examples/activation_offload_resnet.py --tiny     # seconds

Plain torch (no torchvision): a ResNet-style CNN with BatchNorm, random images.
"""

from __future__ import annotations

import argparse
import tempfile

import torch
import torch.nn.functional as F
from torch import nn

import hetstore


class ResBlock(nn.Module):
    def __init__(self, channels: int):
        super().__init__()
        self.conv1 = nn.Conv2d(channels, channels, 3, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(channels)
        self.conv2 = nn.Conv2d(channels, channels, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(channels)

    def forward(self, x):
        y = F.relu(self.bn1(self.conv1(x)))
        return F.relu(x + self.bn2(self.conv2(y)))


class ResNet(nn.Module):
    def __init__(self, channels: int, depth: int, classes: int = 10):
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, channels, 3, padding=1), nn.BatchNorm2d(channels))
        self.blocks = nn.Sequential(*(ResBlock(channels) for _ in range(depth)))
        self.fc = nn.Linear(channels, classes)

    def forward(self, x, targets):
        x = self.blocks(F.relu(self.stem(x)))
        return F.cross_entropy(self.fc(x.mean(dim=(2, 3))), targets)


def train(args, offload_activations: str, offload_path: str) -> None:
    torch.manual_seed(0)
    model = ResNet(args.channels, args.depth)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    config = hetstore.OffloadConfig(
        offload_param="cpu",
        offload_optimizer="cpu",
        offload_activations=offload_activations,
        max_device_memory=args.max_device_memory,
        activation_min_bytes=args.activation_min_bytes,
        offload_path=offload_path,
        enable_pinned_mem=torch.cuda.is_available(),
    )
    model, optimizer = hetstore.offload(model, optimizer, config)
    g = torch.Generator().manual_seed(0)
    device = config.resolved_device()
    for step in range(args.steps):
        x = torch.randn(args.batch, 3, args.size, args.size, generator=g).to(device)
        y = torch.randint(0, 10, (args.batch,), generator=g).to(device)
        loss = model(x, y)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        print(f"step {step}: loss {loss.item():.4f}")
    peak = hetstore.memory_stats(model)["device"]["peak"]
    print(f"device peak {peak / 2**20:.1f} MiB of {config.max_device_memory / 2**20:.1f} MiB")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--size", type=int, default=32)
    parser.add_argument("--channels", type=int, default=32)
    parser.add_argument("--depth", type=int, default=4)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--max-device-memory", default="64MB")
    parser.add_argument("--activation-min-bytes", default="1MB")
    parser.add_argument("--tiny", action="store_true", help="a seconds-long run")
    args = parser.parse_args()
    if args.tiny:
        args.batch, args.size, args.channels, args.depth, args.steps = 64, 16, 8, 3, 2
        args.max_device_memory, args.activation_min_bytes = "2MB", "16KB"
    with tempfile.TemporaryDirectory() as path:
        print(f"== offload_activations='none', max_device_memory={args.max_device_memory}")
        try:
            train(args, "none", path)
        except hetstore.OutOfDeviceMemory as err:
            print(f"stopped as expected:\n{err}")
        else:
            raise SystemExit("expected OutOfDeviceMemory without activation offload")
        print(f"\n== offload_activations='cpu', max_device_memory={args.max_device_memory}")
        train(args, "cpu", path)


if __name__ == "__main__":
    main()
