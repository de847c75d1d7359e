"""docs/performance.md, generated from the result records in benchmarks/results/*.json.

    .venv/bin/python tools/perf_page.py            # rewrite docs/performance.md
    .venv/bin/python tools/perf_page.py --check    # exit 1 if the page and the results disagree
    .venv/bin/python tools/perf_page.py --stdout   # print the page instead of writing it

A *result record* is a JSON object with ``"schema": "hetstore-result/1"`` (other JSON files
in benchmarks/results, such as a benchmark's raw dump, are ignored unless a record names
them). Its fields:

- ``scenario``: one of ``SCENARIOS`` below (the page has one table for each);
- ``date`` (``YYYY-MM-DD``, optionally ``THH:MM``), ``machine``, ``commit``, ``command``:
  shown in every row of the record; ``commit_note`` (optional) says how the commit is known;
- ``source``: the file the figures come from (a benchmark's text output they were
  transcribed from, or a raw JSON they are derived from), or null when the benchmark
  wrote the record itself (``benchmarks/_common.record_json``); ``provenance`` says which;
- ``rows``: one object per measured configuration, each with a ``config`` naming it and
  the scenario's figures; or ``derive`` (the name of a function here that reads the
  ``source`` JSON) and ``config``, for a record whose one row is computed from a raw dump;
- ``notes`` (optional): sentences printed under the table.

*Current* means: for each scenario and ``config``, the row of the newest ``date``. A
newer run of the same configuration replaces the older row without deleting its file;
two rows of one configuration with the same date are an error (give a time or drop one).
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
RESULTS = REPO / "benchmarks" / "results"
PAGE = REPO / "docs" / "performance.md"
SCHEMA = "hetstore-result/1"
REQUIRED = ("scenario", "date", "machine", "commit", "command", "source", "provenance")
COMMAND = ".venv/bin/python tools/perf_page.py"

Row = dict[str, Any]


# ---------------------------------------------------------------------- formatting
def num(value: Any, spec: str) -> str:
    """A number in ``spec``, a string as it is, '-' for nothing."""
    if value is None:
        return "-"
    if isinstance(value, bool) or not isinstance(value, int | float):
        return str(value)
    return format(value, spec)


def bold(text: str) -> str:
    return text if text == "-" else f"**{text}**"


def pair(row: Row, a: str, b: str, spec: str = "") -> str:
    if row.get(a) is None and row.get(b) is None:
        return "-"
    return f"{num(row.get(a), spec)} / {num(row.get(b), spec)}"


def phases(row: Row) -> str:
    keys = ("fwd_s", "bwd_s", "opt_s")
    if all(row.get(k) is None for k in keys):
        return "-"
    return " / ".join(num(row.get(k), ".3f") for k in keys)


def gib(nbytes: float) -> str:
    return f"{nbytes / 2**30:.2f} GiB"


def natural(text: str) -> tuple:
    """A sort key that puts 'batch 8' before 'batch 16'."""
    return tuple(int(p) if p.isdigit() else p for p in re.split(r"(\d+)", text))


def cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


@dataclass(frozen=True)
class Column:
    header: str
    value: Callable[[Row], str]


@dataclass(frozen=True)
class Scenario:
    key: str
    title: str
    intro: str
    columns: tuple[Column, ...]


def col(header: str, key: str, spec: str = "", strong: bool = False) -> Column:
    def value(row: Row) -> str:
        text = num(row.get(key), spec)
        return bold(text) if strong else text

    return Column(header, value)


# ---------------------------------------------------------------------- the scenarios
SCENARIOS: tuple[Scenario, ...] = (
    Scenario(
        "train_step",
        "Host offload",
        "Parameters, gradients and optimizer states in host memory, the model trained on a "
        "CPU device, against plain PyTorch on the same model and batches in the same run "
        "(`benchmarks/train_step.py`: each side in its own process, in lockstep). "
        "*time / plain* is the median of per-step ratios; below 1 is faster than plain.",
        (
            col("plain step s", "plain_s", ".3f"),
            col("hetstore step s", "hetstore_s", ".3f"),
            col("time / plain", "ratio", ".3f", strong=True),
            Column("hetstore fwd / bwd / opt s", phases),
            Column("peak RSS, plain / hetstore", lambda r: pair(r, "plain_rss", "hetstore_rss")),
            col("hetstore host peak", "host_peak"),
            col("max loss difference from plain", "loss_diff"),
        ),
    ),
    Scenario(
        "disk_offload",
        "Disk offload",
        "Parameters, gradients and optimizer states on disk (`benchmarks/disk_offload.py`, "
        "CPU device), against plain PyTorch in the same run, each variant in its own "
        "process, in lockstep. The variants: *disk (defaults)* sets `offload_param` and "
        "`offload_optimizer` to `disk` and leaves every other key at its default; *disk* "
        "adds `overlap_step=True, step_in_forward=False` (the defaults until 2026-11-26: "
        "every step done when `optimizer.step()` returns); *disk (no overlap)* "
        "`overlap_step=False` (every step after backward). With a clip, the gradient norm "
        "is clipped at that value before each step; where it bites, the steps taken "
        "during backward are rolled back and taken again. The engine bandwidth is what "
        "hetstore's own IO engine measured on the same disk in the same rounds: the step "
        "time depends on it.",
        (
            col("clip bit in", "clip_bites"),
            col("plain step s", "plain_s", ".3f"),
            col("hetstore step s", "hetstore_s", ".3f"),
            col("time / plain", "ratio", ".2f", strong=True),
            Column("hetstore fwd / bwd / opt s", phases),
            Column("disk read / written per step", lambda r: pair(r, "disk_read", "disk_written")),
            Column("peak RSS, plain / hetstore", lambda r: pair(r, "plain_rss", "hetstore_rss")),
            Column(
                "engine read / write GB/s", lambda r: pair(r, "engine_read", "engine_write", ".2f")
            ),
            col("max relative loss difference from plain", "loss_diff"),
        ),
    ),
    Scenario(
        "vs_deepspeed",
        "Against DeepSpeed ZeRO-3 offload",
        "The same GPT from identical initial weights on the same batches, hetstore and "
        "DeepSpeed ZeRO-3 with CPU or NVMe offload (DeepSpeedCPUAdam), one process each, in "
        "lockstep (`benchmarks/vs_deepspeed.py`). Ratios are hetstore / DeepSpeed, medians "
        "of per-step ratios: below 1 means hetstore is faster or smaller. *hetstore / plain* "
        "is against plain PyTorch in the same lockstep, where the run had that worker.",
        (
            col("hetstore step s", "hetstore_s", ".3f"),
            col("DeepSpeed step s", "deepspeed_s", ".3f"),
            col("step time, hetstore / DeepSpeed", "ratio", ".2f", strong=True),
            col("hetstore / plain", "hetstore_over_plain", ".2f"),
            Column(
                "peak RSS, hetstore / DeepSpeed", lambda r: pair(r, "hetstore_rss", "deepspeed_rss")
            ),
            col("RSS ratio", "rss_ratio", ".2f", strong=True),
            col("max relative loss difference", "loss_diff"),
        ),
    ),
    Scenario(
        "largest_model",
        "Largest model",
        "The largest models trained on one machine with 24 GiB of RAM, states on disk "
        "(`benchmarks/largest_model.py`; CPU device, fp32 compute, batch 1 x 64 tokens, "
        "AdamW lr 3e-6). No plain-PyTorch run fits beside them; the reference is the disk's "
        "bandwidth, measured by hetstore's IO engine in the same run. *step s* is the last "
        "step's (the first reads no moments).",
        (
            col("parameters", "params"),
            col("optimizer states", "state_format"),
            col("placement", "placement"),
            col("budgets", "budgets"),
            col("step s", "step_s", strong=True),
            col("loss", "loss"),
            col("disk read / written per step", "disk_traffic"),
            col("states on disk", "states_on_disk"),
            col("peak RSS", "peak_rss"),
            col("engine read / write GB/s", "engine_bw"),
        ),
    ),
    Scenario(
        "planner",
        "Planner accuracy",
        "`auto_offload` with budgets as a fraction of the model states, on a GPT and a "
        "transformers Llama (`benchmarks/planner.py`, CPU device): *budget 20%* is a device "
        "budget of 20% of the states; *host 100%* adds a host budget of 100% of them, so "
        "some states go to disk; *budgets only* passes no `example_inputs` (the first batch "
        "is traced and planned for). *pre-run / measured* is "
        "the step time the planner predicted before the first step over the median "
        "measured; *calibrated* is its prediction after profiling a step. The peak columns "
        "are measured / predicted for each tier the plan uses; *peak RSS* is measured over "
        "predicted device + host + the process's start-up size.",
        (
            col("compute basis", "basis"),
            col("predicted before step 1, ms", "predicted_ms", "d"),
            col("measured (median), ms", "measured_ms", "d"),
            col("pre-run / measured", "pre_over_measured", ".2f", strong=True),
            col("calibrated / measured", "calibrated_over_measured", ".2f"),
            col("measured / plain", "measured_over_plain", ".2f"),
            Column(
                "peaks device / host / disk, measured / predicted",
                lambda r: " / ".join(
                    num(r.get(k), ".2f") for k in ("device_peak", "host_peak", "disk_peak")
                ),
            ),
            col("peak RSS, measured / predicted", "rss", ".2f"),
        ),
    ),
    Scenario(
        "gpu_offload_step",
        "GPU (H100)",
        "A 185M GPT (width 1024, 12 blocks, vocab 32768), fused AdamW, on one GPU "
        "(`benchmarks/gpu/offload_step.py`): each row against plain PyTorch in the same "
        "process, the steps interleaved. A variant `PARAM-OPTIM` names `offload_param` and "
        "`offload_optimizer`; `:no-overlap` sets `overlap_step=False`, `:in-forward` "
        "`step_in_forward=True`. *CUDA peak (own)* is what the model holds between steps "
        "plus the most its step allocated above that; *GPU busy* is the share of one "
        "profiled step in which any kernel or copy ran.",
        (
            col("plain step s", "plain_s", ".3f"),
            col("hetstore step s", "hetstore_s", ".3f"),
            col("time / plain", "ratio", ".2f", strong=True),
            Column("hetstore fwd / bwd / opt s", phases),
            Column(
                "CUDA peak (own), plain / hetstore",
                lambda r: pair(r, "plain_peak", "hetstore_peak"),
            ),
            col("GPU busy", "gpu_busy"),
            col("max loss difference from plain", "loss_diff"),
        ),
    ),
    Scenario(
        "gpu_step_table",
        "GPU: the step table under bf16",
        "`benchmarks/gpu/run_all.sh` (`benchmarks/gpu/step_table.py`): the 185M GPT and a "
        "0.95B transformers Llama under `torch.autocast(bfloat16)`, fp32 master weights, "
        "fused AdamW, each row against plain PyTorch (the model and AdamW on the GPU) in "
        "the same process, every runner one step a round in a seeded random order. "
        "*hetstore host*: parameters and states in pinned host memory, `compute_dtype="
        "'bf16'`, every other key at its default (from `cc9decb` on a GPU: the host units' "
        "ordinary steps in the next forward, timed in steady state; before it, stepped "
        "speculatively in backward); *no-overlap*: `overlap_step=False, step_in_forward="
        "False`; *in-backward*: `overlap_step=True, step_in_forward=False` at `cc9decb` (the "
        "default's way before it; host units are no longer stepped in backward from "
        "`af3219d`, so the row is not measured again); *in-forward*: `step_in_forward=True` (the default's way "
        "from `cc9decb`); *step_in_backward*: `step_in_backward=True` (from `3736e87`: each "
        "block's ordinary host step in place on the worker beside the rest of backward, "
        "the root's in the next forward; no clipping, which it refuses); *states on "
        "host*: `offload_param='none'`, the bf16 parameters on "
        "the GPU and the master and states in pinned host memory (torchao's placement; "
        "from `28adb68`); *disk*: everything on disk, defaults (its left-over steps "
        "finished inside its timed step: an upper bound). Peers: FSDP2 `CPUOffloadPolicy` "
        "(one rank, bf16 `MixedPrecisionPolicy`) and torchao's `CPUOffloadOptimizer`. "
        "*GPU busy*: the share of one profiled step in which any kernel or copy ran. "
        "*steps*: the timed steps per row (the script's time budget). From `9ac651c` each "
        "hetstore row whose `overlap_step='auto'` measures overlap against none runs that "
        "trial alone after each batch shape's warm-up round, so its timed steps take the "
        "way a long run keeps (before, they timed the untried default: the trial starts "
        "after 20 steps), and a row whose warm-up step took over 2 s (the disk rows) takes "
        "one timed step per shape.",
        (
            col("median step ms", "step_ms"),
            col("/ plain", "ratio", strong=True),
            col("GPU busy", "gpu_busy"),
            col("peak CUDA (own)", "peak"),
            col("max loss difference from plain", "loss_diff"),
            col("timed steps", "steps"),
        ),
    ),
    Scenario(
        "evict_restore",
        "Evict and restore (RL colocation)",
        "`hetstore.evict` and `hetstore.restore` of a GPT whose states all live on the "
        "device, against a plain copy of the same bytes in the same run, interleaved "
        "(`benchmarks/evict_restore.py`): *copy out* and *copy in* into preallocated "
        "buffers (pinned `copy_` on CUDA); *alloc + copy in* also allocates the device "
        "bytes, as restore must (they were given back): `torch.empty` page-faults fresh "
        "memory there, where restore's `resize_` of the storages evict freed gets "
        "recycled pages back.",
        (
            col("hetstore GiB/s", "gib_s", ".2f"),
            col("reference GiB/s", "reference_gib_s", ".2f"),
            col("hetstore / reference", "ratio", ".2f", strong=True),
            col("bytes moved", "bytes"),
        ),
    ),
)
BY_KEY = {s.key: s for s in SCENARIOS}
RUN_COLUMNS = ("machine", "commit", "date", "command")


# ---------------------------------------------------------------------- derived rows
def _largest_model(raw: dict[str, Any]) -> Row:
    """One row from benchmarks/largest_model.py's JSON dump."""
    args, steps = raw["args"], raw["steps"]
    last = steps[-1]
    read = sum(p["read"] for p in last["phases"].values())
    written = sum(p["written"] for p in last["phases"].values())
    if args.get("auto"):
        placement = "auto_offload (budgets only)"
    else:
        placement = "parameters and optimizer states on disk"
    disk = "disk: " + gib(raw["free_before"]) + " free"
    budgets = f"device {args['max_device_memory']}, host {args['offload_cpu_size']}, {disk}"
    return {
        "params": f"{raw['params'] / 1e9:.2f}B ({raw['params']:,})",
        "state_format": args["state_format"],
        "placement": placement + ("" if args.get("no_step_in_backward") else ", steps in backward"),
        "budgets": budgets,
        "step_s": f"{last['seconds']:.0f} (step {last['step']})",
        "loss": " → ".join(f"{s['loss']:.2f}" for s in steps),
        "disk_traffic": f"{gib(read)} / {gib(written)}",
        "states_on_disk": f"{gib(raw['state_bytes'])} ({raw['state_bytes'] / raw['params']:.2f} "
        "B/param)",
        "peak_rss": gib(max(s["peak_rss"] for s in steps)),
        "engine_bw": f"{raw['read_bw'] / 1e9:.2f} / {raw['write_bw'] / 1e9:.2f}",
    }


DERIVE: dict[str, Callable[[dict[str, Any]], Row]] = {"largest_model": _largest_model}


# ---------------------------------------------------------------------- records
def is_record(data: Any) -> bool:
    return isinstance(data, dict) and data.get("schema") == SCHEMA


def load_records(results: Path = RESULTS) -> list[tuple[str, dict[str, Any]]]:
    """Every result record in ``results``: (file name, record), by file name."""
    records = []
    for path in sorted(results.glob("*.json")):
        data = json.loads(path.read_text())
        if is_record(data):
            check_record(path.name, data)
            records.append((path.name, data))
    return records


def check_record(name: str, record: dict[str, Any]) -> None:
    missing = [k for k in REQUIRED if k not in record]
    if missing:
        raise ValueError(f"{name}: missing {missing}")
    if record["scenario"] not in BY_KEY:
        raise ValueError(f"{name}: unknown scenario {record['scenario']!r} (one of {list(BY_KEY)})")
    if ("rows" in record) == ("derive" in record):
        raise ValueError(f"{name}: give either rows or derive")
    if "derive" in record and record["derive"] not in DERIVE:
        raise ValueError(f"{name}: unknown derive {record['derive']!r}")
    for row in record.get("rows", []):
        if not row.get("config"):
            raise ValueError(f"{name}: a row without config")


def rows_of(record: dict[str, Any]) -> list[Row]:
    if "rows" in record:
        return record["rows"]
    raw = json.loads((REPO / record["source"]).read_text())
    return [{"config": record["config"], **DERIVE[record["derive"]](raw)}]


def current(records: list[tuple[str, dict[str, Any]]]) -> dict[str, list[tuple[str, dict, Row]]]:
    """For each scenario, its current rows: (file, record, row), the newest per config."""
    newest: dict[tuple[str, str], tuple[str, dict, Row]] = {}
    for name, record in records:
        for row in rows_of(record):
            key = (record["scenario"], row["config"])
            seen = newest.get(key)
            if seen is not None and seen[1]["date"] == record["date"]:
                raise ValueError(
                    f"{key[1]!r} ({key[0]}) is in {seen[0]} and {name}, both dated "
                    f"{record['date']}: give one a time (YYYY-MM-DDTHH:MM) or drop a row"
                )
            if seen is None or record["date"] > seen[1]["date"]:
                newest[key] = (name, record, row)
    by_scenario: dict[str, list[tuple[str, dict, Row]]] = {s.key: [] for s in SCENARIOS}
    for name, record, row in newest.values():
        by_scenario[record["scenario"]].append((name, record, row))
    return by_scenario


# ---------------------------------------------------------------------- the page
def render(records: list[tuple[str, dict[str, Any]]]) -> str:
    by_scenario = current(records)
    out = [
        "# Performance",
        "",
        "<!-- Generated by tools/perf_page.py from benchmarks/results/*.json: do not edit. -->",
        "",
        f"This page is generated: `{COMMAND}` writes it from the result records in "
        "`benchmarks/results/*.json`, and `tests/docs/test_performance_page.py` fails when "
        "the page and the records disagree. Edit or add a record, then run the command.",
        "",
        "One table per scenario, each row the newest measurement of its configuration, "
        "with the machine, commit, date and command that produced it. The machines are "
        "shared and noisy, so every benchmark measures hetstore and its reference in the "
        "same run and reports ratios; compare ratios within one machine. Each table's "
        "sources say which file every figure comes from. How the numbers were arrived "
        "at, and every earlier run, is in the development notebook, "
        "[docs/dev/BENCHMARKS.md](dev/BENCHMARKS.md).",
        "",
        "| scenario | current rows | newest run |",
        "|---|---|---|",
    ]
    for s in SCENARIOS:
        rows = by_scenario[s.key]
        newest = max((r["date"] for _, r, _ in rows), default="-")
        anchor = s.title.lower().replace(" ", "-").replace("(", "").replace(")", "")
        anchor = "".join(c for c in anchor if c.isalnum() or c == "-")
        out.append(f"| [{s.title}](#{anchor}) | {len(rows)} | {newest} |")
    for s in SCENARIOS:
        out += ["", f"## {s.title}", "", s.intro, ""]
        rows = by_scenario[s.key]
        if not rows:
            out.append("No result recorded yet.")
            continue
        header = ["configuration"] + [c.header for c in s.columns] + list(RUN_COLUMNS)
        out.append("| " + " | ".join(header) + " |")
        out.append("|" + "---|" * len(header))
        for _, record, row in sorted(rows, key=lambda t: natural(t[2]["config"])):
            cells = [row["config"]] + [c.value(row) for c in s.columns]
            cells += [record["machine"], f"`{record['commit']}`", record["date"]]
            cells.append(f"`{record['command']}`")
            out.append("| " + " | ".join(cell(c) for c in cells) + " |")
        used = sorted({name for name, _, _ in rows})
        records_used = {name: r for name, r, _ in rows}
        notes = [n for name in used for n in records_used[name].get("notes", ())]
        if notes:
            out.append("")
            out += [f"- {n}" for n in dict.fromkeys(notes)]
        out += ["", "Sources:", ""]
        for name in used:
            r = records_used[name]
            text = f"- `benchmarks/results/{name}`"
            if r["source"]:
                text += f", from `{r['source']}`"
            text += f": {r['provenance']}."
            if r.get("commit_note"):
                text += f" Commit: {r['commit_note']}."
            out.append(text)
    return "\n".join(out) + "\n"


def page_text(results: Path = RESULTS) -> str:
    return render(load_records(results))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    group = parser.add_mutually_exclusive_group()
    group.add_argument("--check", action="store_true", help="exit 1 if the page is stale")
    group.add_argument("--stdout", action="store_true", help="print the page")
    args = parser.parse_args(argv)
    text = page_text()
    if args.stdout:
        sys.stdout.write(text)
        return 0
    if args.check:
        if PAGE.read_text() != text:
            print(f"{PAGE.relative_to(REPO)} is stale: run {COMMAND}", file=sys.stderr)
            return 1
        return 0
    PAGE.write_text(text)
    print(f"wrote {PAGE.relative_to(REPO)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
