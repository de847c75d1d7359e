"""Pictures of a run: the per-tier memory timeline of a step and the loss curve (PNG).

matplotlib is imported here only (the ``demo`` extra): training never needs it. It draws
with the Agg backend, so no display is needed.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path

from hetstore._sizes import format_size
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
    """Each tier's bytes in use over the recorded step, phases shaded, each tier's budget
    dashed in its colour. Returns the path written."""
    if not timeline.samples:
        raise ValueError("the timeline has no samples")
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(11, 4.5), dpi=110)
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
    peak = max((_mib(v) for s in timeline.samples for v in s[1:]), default=0.0)
    top = peak
    for tier in TIER_LABELS:
        budget = timeline.capacities.get(tier)
        if not budget:
            continue
        # every budget is drawn and named; one far above what the step used (the disk's
        # free space) would flatten the curves, so the axis stops short of it
        shown = _mib(budget) <= 3 * max(peak, 1e-9)
        if shown:
            top = max(top, _mib(budget))
        ax.axhline(
            _mib(budget),
            color=Tier.from_label(tier).color,
            linestyle="--",
            linewidth=1,
            label=f"{tier} budget {format_size(budget)}" + ("" if shown else " (above the plot)"),
        )
    ax.set_xlabel("time in the step (ms)")
    ax.set_ylabel("bytes in use (MiB)")
    ax.set_xlim(0, end)
    ax.set_ylim(0, top * 1.08 or 1)
    # beside the axes, not over the curves
    ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=8, borderaxespad=0)
    if timeline.title:
        ax.set_title(timeline.title, fontsize=9, pad=18)
    fig.tight_layout()
    path = Path(path)
    fig.savefig(path)
    plt.close(fig)
    return path


def plot_losses(curves: Mapping[str, Sequence[float]], path: str | Path, title: str = "") -> Path:
    """One line per run (e.g. hetstore and plain PyTorch). With two runs or more, the
    curves lie on each other when they agree, so a second panel shows each run's
    |difference| from the first, step by step, and the legend its largest. Returns the
    path written."""
    plt = _pyplot()
    runs = list(curves.items())
    compare = len(runs) > 1
    if compare:
        fig, (ax, dax) = plt.subplots(
            2, 1, figsize=(7, 5.5), dpi=110, sharex=True, gridspec_kw={"height_ratios": [3, 2]}
        )
    else:
        fig, ax = plt.subplots(figsize=(7, 4), dpi=110)
    styles = ["-", "--", ":"]
    first_label, first = runs[0]
    for i, (label, losses) in enumerate(runs):
        if i:
            diff = [abs(a - b) for a, b in zip(losses, first, strict=False)]
            label = f"{label} (max |Δ| from {first_label}: {max(diff, default=0.0):.1e})"
        ax.plot(range(1, len(losses) + 1), losses, styles[i % 3], label=label, linewidth=1.6)
    ax.set_ylabel("training loss")
    ax.legend(fontsize=9)
    if compare:
        for i, (label, losses) in enumerate(runs[1:], start=1):
            diff = [abs(a - b) for a, b in zip(losses, first, strict=False)]
            dax.plot(range(1, len(diff) + 1), diff, styles[i % 3], color=f"C{i}", label=label)
        dax.set_ylabel(f"|loss - {first_label}|")
        dax.set_ylim(bottom=0)
        dax.ticklabel_format(axis="y", style="sci", scilimits=(-3, 3))
        dax.set_xlabel("step")
    else:
        ax.set_xlabel("step")
    if title:
        ax.set_title(title, fontsize=10)
    fig.tight_layout()
    path = Path(path)
    fig.savefig(path)
    plt.close(fig)
    return path
