"""A small ResNet-style CNN with BatchNorm, written in plain torch (no torchvision here)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


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
    def __init__(self, channels=8, depth=3, classes=10):
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, channels, 3, padding=1), nn.BatchNorm2d(channels))
        self.blocks = nn.Sequential(*(ResBlock(channels) for _ in range(depth)))
        self.fc = nn.Linear(channels, classes)

    def forward(self, x, targets=None):
        x = self.blocks(F.relu(self.stem(x)))
        logits = self.fc(x.mean(dim=(2, 3)))
        if targets is None:
            return logits
        return F.cross_entropy(logits, targets)


def image_batches(n, *, batch=4, size=8, classes=10, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [
        (
            torch.randn(batch, 3, size, size, generator=g),
            torch.randint(0, classes, (batch,), generator=g),
        )
        for _ in range(n)
    ]
