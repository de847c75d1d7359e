"""docs/performance.md is generated from benchmarks/results/*.json (tools/perf_page.py):
the page on disk must be what the records give, and every transcribed figure must be in
the benchmark output it was copied from."""

from __future__ import annotations

import importlib.util
import json
import re
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def _load(path: Path, name: str):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def perf_page():
    """tools/perf_page.py, loaded by path (tools/ is not a package)."""
    return _load(REPO / "tools" / "perf_page.py", "hetstore_tools_perf_page")


@pytest.fixture(scope="module")
def records(perf_page):
    return perf_page.load_records()


def test_the_page_is_what_the_results_give(perf_page, records):
    expected = perf_page.render(records)
    actual = (REPO / "docs" / "performance.md").read_text()
    assert actual == expected, (
        "docs/performance.md and benchmarks/results/*.json disagree: "
        "run .venv/bin/python tools/perf_page.py"
    )


def test_the_page_says_it_is_generated_and_by_what(perf_page):
    head = (REPO / "docs" / "performance.md").read_text()[:1000]
    assert "generated" in head
    assert perf_page.COMMAND in head


def test_every_scenario_has_a_current_row(perf_page, records):
    current = perf_page.current(records)
    empty = [s.key for s in perf_page.SCENARIOS if not current[s.key]]
    assert empty == []
    for rows in current.values():
        for _, record, _ in rows:
            for field in ("machine", "commit", "date", "command"):
                assert record[field], (record["scenario"], field)


def _numbers(text: str) -> set[float]:
    return {float(m) for m in re.findall(r"-?\d+(?:\.\d+)?(?:[eE][-+]?\d+)?", text)}


def test_transcribed_figures_are_in_their_source(records):
    """A record copied from a benchmark's text output invents nothing: each number is
    among the source's numbers, each text figure (a size, a percentage) in it verbatim."""
    transcribed = [(n, r) for n, r in records if (r["source"] or "").endswith(".txt")]
    assert transcribed
    for name, record in transcribed:
        text = (REPO / record["source"]).read_text()
        numbers = _numbers(text)
        for row in record["rows"]:
            for key, value in row.items():
                if key == "config" or value is None:
                    continue
                if isinstance(value, int | float):
                    assert float(value) in numbers, (name, row["config"], key, value)
                else:
                    assert str(value) in text, (name, row["config"], key, value)


def test_every_source_exists(records):
    for name, record in records:
        if record["source"]:
            assert (REPO / record["source"]).is_file(), (name, record["source"])


def test_a_newer_record_of_a_configuration_replaces_the_older_row(perf_page, records, tmp_path):
    old = next(r for _, r in records if r["scenario"] == "train_step" and "rows" in r)
    newer = json.loads(json.dumps(old))
    newer["date"] = old["date"] + "T23:59"
    newer["rows"][0]["ratio"] = 0.5
    (tmp_path / "old.json").write_text(json.dumps(old))
    (tmp_path / "new.json").write_text(json.dumps(newer))
    current = perf_page.current(perf_page.load_records(tmp_path))["train_step"]
    assert [(name, row["ratio"]) for name, _, row in current] == [("new.json", 0.5)]
    newer["date"] = old["date"]
    (tmp_path / "new.json").write_text(json.dumps(newer))
    with pytest.raises(ValueError, match="both dated"):
        perf_page.current(perf_page.load_records(tmp_path))


def test_record_json_writes_a_record_the_page_shows(perf_page, tmp_path):
    common = _load(REPO / "benchmarks" / "_common.py", "hetstore_bench_common")
    row = {"config": "a test configuration", "plain_s": 1.0, "hetstore_s": 1.05, "ratio": 1.05}
    common.record_json(
        tmp_path / "train_step_test.json",
        scenario="train_step",
        rows=[row],
        command=common.bench_command("benchmarks/train_step.py", ["--steps", "2", "--json", "x"]),
        machine="a test machine",
        commit="0000000",
        date="2999-01-01",
    )
    page = perf_page.render(perf_page.load_records(tmp_path))
    line = next(line for line in page.splitlines() if "a test configuration" in line)
    assert "**1.050**" in line
    assert "`.venv/bin/python benchmarks/train_step.py --steps 2`" in line
    assert "a test machine" in line and "`0000000`" in line and "2999-01-01" in line
    with pytest.raises(ValueError, match="config"):
        common.record_json(
            tmp_path / "bad.json", scenario="train_step", rows=[{}], command="x", machine="y"
        )
