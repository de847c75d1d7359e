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


def test_demo_writes_the_memory_timeline_and_loss_pictures(demo_run):
    done, out = demo_run
    for name in ("memory_timeline.png", "loss.png"):
        data = (out / name).read_bytes()
        assert data.startswith(PNG_MAGIC) and len(data) > 10_000, name
    import json

    timeline = json.loads((out / "timeline.json").read_text())
    assert [p[1] for p in timeline["phases"]] == ["forward", "backward", "step"]
    assert max(s[1] for s in timeline["samples"]) <= timeline["capacities"]["device"]


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
        (["--offload-path", "/proc/hetstore"], "offload_path: cannot use '/proc/hetstore'"),
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
