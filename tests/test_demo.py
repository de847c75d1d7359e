"""`hetstore demo` (what `make demo` runs): trains within a budget the states exceed."""

from __future__ import annotations

import io

from hetstore.demo import DemoSettings, run_demo


def test_demo_trains_within_budget_and_matches_plain(capsys):
    out = io.StringIO()
    settings = DemoSettings(steps=4, compare=True)  # the default model, fewer steps
    assert run_demo(settings, out=out) == 0
    text = out.getvalue()
    assert "device peak within budget: yes" in text
    assert "max |loss difference| over 4 steps: 0.00e+00" in text


def test_demo_without_offload_stops_with_the_statistics(capsys):
    settings = DemoSettings(width=64, depth=3, steps=4, no_offload=True)
    assert run_demo(settings, out=io.StringIO()) == 1
    err = capsys.readouterr().err
    assert "out of device memory" in err and "max_device_memory" in err
