"""The command line as a newcomer meets it (issue 49): errors that name the flags to
change, not OffloadConfig's keys; nothing left behind in the working directory; a
progress line on stderr while the machine is probed; step times in units read at a
glance; and `hetstore plan --measure` setting the measured step beside the predicted."""

from __future__ import annotations

import re
from dataclasses import replace

import pytest

from hetstore.__main__ import main
from tests.planner.helpers import CPU

SMALL = ["--device", "cpu", "--width", "256", "--depth", "4", "--vocab", "1000", "--ctx", "128"]
KEYS = ("max_device_memory", "offload_disk_size", "offload_path", "optimizer_state_format")


def run(capsys, *argv) -> tuple[int, str, str]:
    code = main(list(argv))
    captured = capsys.readouterr()
    return code, captured.out, captured.err


@pytest.fixture
def machine(monkeypatch):
    """Rates given, not measured: the tests below check what is printed, not the probes."""
    from hetstore.planner import machine

    monkeypatch.setattr(machine, "measure_machine", lambda *a, **k: CPU)
    return machine


@pytest.mark.parametrize(
    "args, says",
    [
        (["--device-memory", "lots"], "--device-memory 'lots': cannot parse 'lots' as a size"),
        (["--state-format", "x"], "--state-format 'x': allowed values are"),
        (["--device", "tpu"], "--device 'tpu': allowed values are"),
        (["--device-memory", "64KB", "--no-probe"], "(--device-memory); raise --device-memory\n"),
    ],
)
def test_plan_errors_name_the_flags(capsys, tmp_path, machine, args, says):
    code, _, err = run(capsys, "plan", *SMALL, "--path", str(tmp_path / "o"), *args)
    assert code in (1, 2)
    assert says in err, err
    assert not any(key in err for key in KEYS), err
    assert "hbm_ratio" not in err  # a key the command has no flag for is not advised


def test_an_unusable_path_is_named_by_its_flag(capsys):
    code, _, err = run(capsys, "plan", *SMALL, "--path", "/proc/hetstore")
    assert code == 2 and "--path: cannot use '/proc/hetstore' as a directory" in err, err
    assert "point --path at a directory" in err and "offload_path" not in err


def test_a_disk_short_of_free_space_advises_path_and_disk(capsys, tmp_path, machine, monkeypatch):
    """The README's first example on a machine with too little free disk: the advice
    named offload_disk_size, a key the command line has no way to set."""
    monkeypatch.setattr(machine, "free_space_at", lambda path: 1 << 20)
    code, _, err = run(
        capsys, "plan", *SMALL, "--device-memory", "8MB", "--host-memory", "1MB", "--no-probe"
    )
    assert code == 1
    assert "only 1.00 MiB is free at --path './offload' (--disk is not set)" in err, err
    assert "point --path at a disk with at least" in err and "pass --disk SIZE" in err
    assert not any(key in err for key in KEYS), err


def test_bench_errors_name_the_flags(capsys):
    code, _, err = run(capsys, "bench", "--device", "tpu")
    assert code == 2 and "--device 'tpu'" in err and "--path DIR" not in err
    code, _, err = run(capsys, "bench", "--device", "cpu", "--path", "/proc/hetstore")
    assert code == 2 and "--path: cannot use '/proc/hetstore'" in err and "offload_path" not in err


def test_plan_and_bench_leave_nothing_in_the_working_directory(capsys, tmp_path, monkeypatch):
    """Both probe the disk under --path (./offload by default): the directory, created
    for the probe, goes again. Each says on stderr what it is doing while it probes."""
    monkeypatch.chdir(tmp_path)
    code, out, err = run(capsys, "plan", *SMALL, "--device-memory", "24MB", "--no-probe")
    assert code == 0 and "predicted step" in out
    assert "hetstore plan: probing the machine (memory copy, disk, optimizer step" in err
    assert "hetstore plan: tracing the model and searching placements..." in err
    assert "probes: the fastest run of each counts" in out
    code, out, err = run(capsys, "bench", "--device", "cpu")
    assert code == 0 and "disk read" in out
    assert "hetstore bench: probing the machine" in err
    assert list(tmp_path.iterdir()) == []


def test_long_steps_are_printed_in_minutes(capsys, tmp_path, monkeypatch):
    """A plan of a large model on a slow machine: '7.8 min', not '465782.8 ms'."""
    from hetstore.planner import machine

    monkeypatch.setattr(machine, "measure_machine", lambda *a, **k: replace(CPU, flops=1e9))
    code, out, _ = run(
        capsys,
        "plan",
        "--device", "cpu", "--width", "1024", "--depth", "8", "--ctx", "1024",
        "--path", str(tmp_path), "--no-probe",
    )  # fmt: skip
    assert code == 0
    match = re.search(r"predicted step (\S+) (\S+) = compute (\S+) (\S+)", out)
    assert match and match.group(2) in ("s", "min", "h"), out
    assert float(match.group(1)) < 1000


def test_plan_measure_prints_the_measured_step_beside_the_predicted(capsys, tmp_path):
    code, out, err = run(
        capsys, "plan", *SMALL, "--device-memory", "24MB", "--path", str(tmp_path), "--measure", "2"
    )
    assert code == 0, err
    assert re.search(r"measured over 2 steps after 3 profiled ones: median \d", out), out
    assert re.search(r"predicted \S+ \S+ \(the plan above\); measured / predicted \d+\.\d\d", out)
    assert "training 3 profiled + 2 timed steps" in err
    assert list(tmp_path.iterdir()) == []  # the disk tier's files went with the model
    code, _, err = run(capsys, "plan", *SMALL, "--measure", "2", "--max-model")
    assert code == 2 and "--measure" in err
