"""`hetstore demo` (what `make demo` runs) and the rest of the CLI, in subprocesses: exit
codes, what is printed, the pictures written, and one-line errors."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest

from hetstore._sizes import parse_size

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
# depth 6: at depth 4 the disk paths' host staging (a few units' worth, whatever the
# depth) leaves a host budget of the states' size too small, and the demo is refused
SMALL = ["--steps", "8", "--width", "64", "--depth", "6", "--batch", "4", "--no-progress"]


def hetstore(*args, cwd=None):
    return subprocess.run(
        [sys.executable, "-m", "hetstore", *args],
        capture_output=True,
        text=True,
        cwd=cwd,
        timeout=300,
    )


def field(text: str, label: str) -> int:
    """Bytes of a summary line like '  training states      1.23 MiB'."""
    match = re.search(rf"{label}\s+([\d.]+ [KMGT]?i?B)", text)
    assert match, f"no {label!r} in:\n{text}"
    return parse_size(match.group(1))


@pytest.fixture(scope="module")
def demo_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("demo")
    done = hetstore(
        "demo", *SMALL, "--compare", "--out", str(out), "--offload-path", str(out / "o")
    )
    return done, out


def test_demo_trains_within_a_budget_the_states_exceed(demo_run):
    done, _ = demo_run
    assert done.returncode == 0, done.stderr
    text = done.stdout
    budget, states = field(text, "device budget"), field(text, "training states")
    assert budget < states
    assert field(text, "device peak") <= budget
    assert "device peak within budget: yes" in text
    first, last = map(float, re.search(r"loss: first ([\d.]+) -> last ([\d.]+)", text).groups())
    assert last < first
    # the plan is printed, and the losses match plain PyTorch (fp32 on the CPU: the same
    # kernels on the same numbers; 1e-5 leaves room for summation order only)
    assert "predicted step" in text
    diff = float(re.search(r"max \|loss difference\| over 8 steps: (\S+)", text).group(1))
    assert diff <= 1e-5
    # predicted against measured, in units read at a glance, with the probes' spread
    assert re.search(r"step time\s+predicted [\d.]+ (ms|s|min) before training", text), text
    assert re.search(r"measured / predicted: \d+\.\d\d before training", text), text
    assert "probes: the fastest run of each counts" in text
    assert "PinnedMemoryWarning" not in done.stderr  # enable_pinned_mem 'auto' on a CPU


def test_demo_writes_the_memory_timeline_and_loss_pictures(demo_run):
    done, out = demo_run
    for name in ("memory_timeline.png", "loss.png"):
        data = (out / name).read_bytes()
        assert data.startswith(PNG_MAGIC) and len(data) > 10_000, name
    import json

    timeline = json.loads((out / "timeline.json").read_text())
    assert [p[1] for p in timeline["phases"]] == ["forward", "backward", "step"]
    assert max(s[1] for s in timeline["samples"]) <= timeline["capacities"]["device"]


def _drawn(monkeypatch) -> list:
    """The figures the report functions save, kept open to be read."""
    from matplotlib.figure import Figure

    figures = []
    monkeypatch.setattr(Figure, "savefig", lambda fig, *a, **k: figures.append(fig))
    return figures


def test_the_timeline_names_its_step_and_draws_every_budget(demo_run, tmp_path, monkeypatch):
    """Issue 49: the picture showed a recorded step far longer than the median beside
    it without saying so, and only the device budget."""
    from hetstore.report import plot_timeline
    from hetstore.timeline import MemoryTimeline

    _, out = demo_run
    timeline = MemoryTimeline.load(out / "timeline.json")
    assert "during step 4, the first after the profiled ones" in timeline.title
    assert re.search(
        r"this step took \S+ \S+ while recorded, [\d.]+x the median step", timeline.title
    )
    figures = _drawn(monkeypatch)
    plot_timeline(timeline, tmp_path / "t.png")
    (ax,) = figures[0].axes
    labels = ax.get_legend_handles_labels()[1]
    for tier in ("device", "host", "disk"):
        assert any(label.startswith(f"{tier} budget ") for label in labels), labels
    assert ax.get_title() == timeline.title


def test_the_loss_plot_shows_the_difference_from_plain_pytorch(tmp_path, monkeypatch):
    from hetstore.report import plot_losses

    figures = _drawn(monkeypatch)
    curves = {"hetstore": [3.0, 2.5, 2.0], "plain PyTorch": [3.0, 2.5 + 2e-7, 2.0]}
    plot_losses(curves, tmp_path / "l.png")
    top, diff = figures[0].axes
    assert "plain PyTorch (max |Δ| from hetstore: 2.0e-07)" in top.get_legend_handles_labels()[1]
    (line,) = diff.get_lines()
    assert list(line.get_ydata()) == pytest.approx([0.0, 2e-7, 0.0], abs=1e-12)
    figures.clear()
    plot_losses({"hetstore": [3.0, 2.0]}, tmp_path / "one.png")  # one run: one panel
    assert len(figures[0].axes) == 1


def test_the_demo_leaves_only_its_pictures_in_the_working_directory(tmp_path):
    """Run as `make demo` runs it, with the default ./offload: the disk tier's directory
    goes when the demo is done."""
    done = hetstore("demo", *SMALL, cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "loss.png",
        "memory_timeline.png",
        "timeline.json",
    ]


def test_report_redraws_a_saved_timeline(demo_run, tmp_path):
    _, out = demo_run
    png = tmp_path / "again.png"
    done = hetstore("report", str(out / "timeline.json"), "--out", str(png))
    assert done.returncode == 0, done.stderr
    assert png.read_bytes().startswith(PNG_MAGIC)
    (tmp_path / "bad.json").write_text("[1, 2]")
    bad = hetstore("report", str(tmp_path / "bad.json"))
    assert bad.returncode == 2 and "not a hetstore memory timeline" in bad.stderr
    assert "Traceback" not in bad.stderr


def test_no_offload_stops_with_the_statistics(tmp_path):
    done = hetstore("demo", *SMALL, "--no-offload", "--out", str(tmp_path))
    assert done.returncode == 1
    assert "out of device memory" in done.stderr and "max_device_memory" in done.stderr
    assert "Traceback" not in done.stderr


@pytest.mark.parametrize(
    "args, message",
    [
        (["--steps", "0"], "--steps must be at least 1"),
        (["--budget-fraction", "-1"], "--budget-fraction must be in"),
        (["--device", "tpu"], "device"),
        (["--offload-path", "/proc/hetstore"], "--offload-path: cannot use '/proc/hetstore'"),
        (["--config", "missing.yaml"], "cannot read config file"),
        (["--steps", "many"], "invalid int value"),
    ],
)
def test_bad_input_is_one_clear_line(tmp_path, args, message):
    done = hetstore("demo", *SMALL, "--out", str(tmp_path), *args, cwd=tmp_path)
    assert done.returncode == 2, done.stdout + done.stderr
    assert message in done.stderr
    assert "Traceback" not in done.stderr


def test_bad_config_file_names_the_key(tmp_path):
    config = tmp_path / "bad.yaml"
    config.write_text("hbm_ratio: 3\n")
    done = hetstore("demo", *SMALL, "--out", str(tmp_path), "--config", str(config))
    assert done.returncode == 2 and "hbm_ratio" in done.stderr
    assert "Traceback" not in done.stderr


def test_bench_prints_the_machine_table(tmp_path):
    done = hetstore("bench", "--device", "cpu", "--path", str(tmp_path))
    assert done.returncode == 0, done.stderr
    for row in ("host -> device copy", "disk read", "disk write", "host optimizer", "FLOP"):
        assert row in done.stdout


def test_help_lists_every_command():
    done = hetstore("--help")
    assert done.returncode == 0
    for command in ("demo", "plan", "bench", "report"):
        assert command in done.stdout
