"""Pictures of a run: the per-tier memory timeline of a step and the loss curve (PNG).

matplotlib is imported here only (the ``demo`` extra): training never needs it. It draws
with the Agg backend, so no display is needed.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path

from hetstore.errors import ConfigError
from hetstore.tier import TIER_LABELS, Tier
from hetstore.timeline import MemoryTimeline

__all__ = ["plot_timeline", "plot_losses"]

_PHASE_COLORS = {"forward": "#fff3c4", "backward": "#dcebff", "step": "#e6f5e1"}


def _pyplot():
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as exc:
        raise ConfigError("drawing PNGs needs matplotlib: pip install 'hetstore[demo]'") from exc
    return plt


def _mib(nbytes: float) -> float:
    return nbytes / 2**20


def plot_timeline(timeline: MemoryTimeline, path: str | Path) -> Path:
    """Each tier's bytes in use over the recorded step, phases shaded, device budget
    dashed. Returns the path written."""
    if not timeline.samples:
        raise ValueError("the timeline has no samples")
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(9, 4.5), dpi=110)
    times = [s[0] * 1e3 for s in timeline.samples]
    end = times[-1]
    for i, (start, name) in enumerate(timeline.phases):
        stop = timeline.phases[i + 1][0] * 1e3 if i + 1 < len(timeline.phases) else end
        ax.axvspan(start * 1e3, stop, color=_PHASE_COLORS.get(name, "#eeeeee"), zorder=0)
        ax.text(
            (start * 1e3 + stop) / 2,
            1.01,
            name,
            transform=ax.get_xaxis_transform(),
            ha="center",
            va="bottom",
            fontsize=9,
        )
    for column, tier in enumerate(TIER_LABELS, start=1):
        values = [_mib(s[column]) for s in timeline.samples]
        if not any(values):
            continue
        ax.step(
            times,
            values,
            where="post",
            color=Tier.from_label(tier).color,
            label=tier,
            linewidth=1.6,
        )
    budget = timeline.capacities.get("device")
    if budget:
        ax.axhline(
            _mib(budget),
            color=Tier.DEVICE.color,
            linestyle="--",
            linewidth=1,
            label="device budget",
        )
    ax.set_xlabel("time in the step (ms)")
    ax.set_ylabel("bytes in use (MiB)")
    ax.set_xlim(0, end)
    ax.set_ylim(bottom=0)
    ax.legend(loc="upper left", fontsize=9)
    if timeline.title:
        ax.set_title(timeline.title, fontsize=10, pad=18)
    fig.tight_layout()
    path = Path(path)
    fig.savefig(path)
    plt.close(fig)
    return path


def plot_losses(curves: Mapping[str, Sequence[float]], path: str | Path, title: str = "") -> Path:
    """One line per run (e.g. hetstore and plain PyTorch). Returns the path written."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(7, 4), dpi=110)
    styles = ["-", "--", ":"]
    for i, (label, losses) in enumerate(curves.items()):
        ax.plot(range(1, len(losses) + 1), losses, styles[i % 3], label=label, linewidth=1.6)
    ax.set_xlabel("step")
    ax.set_ylabel("training loss")
    ax.legend()
    if title:
        ax.set_title(title, fontsize=10)
    fig.tight_layout()
    path = Path(path)
    fig.savefig(path)
    plt.close(fig)
    return path
