"""Every Python block of README.md and docs/guide/*.md runs as shown.

Each ```python block is written to a file in a fresh temporary directory and run there
with this interpreter, in its own process, under a timeout: a block must be
self-contained (its model, data and config defined in it, at sizes that run in seconds
on a CPU). Markers on the line before a block, in the Markdown source:

- ``<!-- skip: reason -->``: not run here (it needs a GPU, a download, a cluster); the
  test is reported as skipped with the reason.
- ``<!-- file: NAME -->``: a script the page launches in another way; it is written
  out as ``NAME`` and launched by a test of its own below (docs/guide/distributed.md's
  ``train.py``, under torchrun with two gloo ranks).

Other fences (bash, text) are not run. The README's length and the pages' relative
links are checked here too.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs" / "guide").glob("*.md"))]
TIMEOUT_S = 120  # one block; each takes a few seconds on 2 idle cores
README_MAX_LINES = 250

FENCE = re.compile(r"^(\s*)```+\s*([\w+-]*)")
MARKER = re.compile(r"^<!--\s*(skip|file):\s*(.*?)\s*-->$")


@dataclass
class Block:
    page: Path
    line: int  # 1-based line of the opening fence
    lang: str
    code: str
    skip: str | None = None
    file: str | None = None

    @property
    def name(self) -> str:
        return f"{self.page.relative_to(ROOT)}:{self.line}"


def blocks_of(page: Path) -> list[Block]:
    lines = page.read_text().splitlines()
    found, i = [], 0
    while i < len(lines):
        fence = FENCE.match(lines[i])
        if not fence:
            i += 1
            continue
        indent, lang, start = fence.group(1), fence.group(2).lower(), i
        i += 1
        body = []
        while i < len(lines) and not lines[i].strip().startswith("```"):
            body.append(lines[i][len(indent) :] if lines[i].startswith(indent) else lines[i])
            i += 1
        i += 1  # the closing fence
        block = Block(page, start + 1, lang, "\n".join(body) + "\n")
        previous = next((s.strip() for s in reversed(lines[:start]) if s.strip()), "")
        marker = MARKER.match(previous)
        if marker:
            kind, value = marker.groups()
            setattr(block, kind, value)
        found.append(block)
    return found


ALL = [block for page in PAGES for block in blocks_of(page)]
PYTHON = [b for b in ALL if b.lang == "python" and b.file is None]


# blocks and scripts run on the CPU, as on a machine without a GPU (a forked child
# could not use CUDA after its parent touched it, and train.py would start NCCL ranks)
ENV = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "PYTHONPATH": str(ROOT / "src")}
# imported once by the block runner (tests/docs/block_runner.py) before it forks a child
# per block; what is not installed is skipped there, and a block needing it fails
PRELOAD = [
    "torch",
    "torch._dynamo",  # (torch.optim's constructors import it: 1.6 s)
    "hetstore",
    "hetstore.demo.gpt",
    "transformers",
    "transformers.models.llama.modeling_llama",
    "transformers.trainer",
    "accelerate",
    "peft",
    "pytorch_lightning",
]


class Runner:
    """One block runner process for the module's blocks (see block_runner.py); where
    fork is missing, a plain subprocess per block."""

    def __init__(self):
        self.process = None
        if hasattr(os, "fork"):
            self.process = subprocess.Popen(
                [sys.executable, str(Path(__file__).with_name("block_runner.py")), *PRELOAD],
                env=ENV,
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                text=True,
            )
            json.loads(self.process.stdout.readline())  # {"ready": [...]}

    def run(self, script: Path, timeout: float) -> subprocess.CompletedProcess:
        out, err = script.with_suffix(".out"), script.with_suffix(".err")
        if self.process is None:
            return run_python([script.name], script.parent, timeout)
        request = dict(script=str(script), cwd=str(script.parent), stdout=str(out), stderr=str(err))
        print(json.dumps({**request, "timeout": timeout}), file=self.process.stdin, flush=True)
        answer = json.loads(self.process.stdout.readline())
        return subprocess.CompletedProcess(
            [script.name], answer["returncode"], out.read_text(), err.read_text()
        )

    def close(self):
        if self.process is not None:
            self.process.stdin.close()
            self.process.wait(timeout=30)


@pytest.fixture(scope="module")
def runner():
    runner = Runner()
    yield runner
    runner.close()


def run_python(args: list[str], cwd: Path, timeout: float) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, *args], cwd=cwd, env=ENV, capture_output=True, text=True, timeout=timeout
    )


def failure(what: str, code: str, done: subprocess.CompletedProcess) -> str:
    numbered = "\n".join(f"{n:3} {line}" for n, line in enumerate(code.splitlines(), 1))
    return (
        f"{what} failed (exit {done.returncode}; 124: timed out):\n{numbered}\n"
        f"--- stdout\n{done.stdout[-2000:]}\n--- stderr\n{done.stderr[-4000:]}"
    )


@pytest.mark.parametrize("block", PYTHON, ids=[b.name for b in PYTHON])
def test_python_block_runs_as_shown(block: Block, tmp_path, runner):
    if block.skip is not None:
        pytest.skip(f"{block.name}: {block.skip}")
    script = tmp_path / "block.py"
    script.write_text(block.code)
    done = runner.run(script, TIMEOUT_S)
    assert done.returncode == 0, failure(block.name, block.code, done)


def test_distributed_train_py_runs_under_torchrun_with_two_gloo_ranks(tmp_path):
    """docs/guide/distributed.md's train.py, as `torchrun --nproc_per_node 2 train.py`
    runs it on a CPU machine (--standalone: a free port, so it cannot meet another
    test's ranks)."""
    (script,) = [b for b in ALL if b.file == "train.py"]
    (tmp_path / "train.py").write_text(script.code)
    done = run_python(
        ["-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", "train.py"],
        tmp_path,
        TIMEOUT_S,
    )
    assert done.returncode == 0, failure(script.name, script.code, done)
    assert "rank 0" in done.stdout and "rank 1" in done.stdout, done.stdout


def test_every_marker_is_known_and_every_file_block_is_launched():
    launched = {"train.py"}  # the scripts the tests above launch
    for block in ALL:
        if block.file is not None:
            assert block.file in launched, f"{block.name}: no test launches {block.file}"
        if block.skip is not None:
            assert block.skip, f"{block.name}: a skip marker needs a reason"
            assert block.lang == "python", f"{block.name}: skip marker before a {block.lang} block"
    for page in PAGES:
        for n, line in enumerate(page.read_text().splitlines(), 1):
            if line.strip().startswith("<!--") and ("skip:" in line or "file:" in line):
                assert MARKER.match(line.strip()), f"{page.name}:{n}: malformed marker {line!r}"


def test_readme_stays_short():
    lines = len((ROOT / "README.md").read_text().splitlines())
    assert lines <= README_MAX_LINES, f"README.md has {lines} lines (at most {README_MAX_LINES})"


def test_readme_lists_the_whole_public_api():
    import hetstore

    text = (ROOT / "README.md").read_text()
    section = text[text.index("## Public API") :]
    section = section[: section.index("\n## ", 1)]
    named = set(re.findall(r"\w+", " ".join(re.findall(r"`([^`]*)`", section))))
    missing = [name for name in hetstore.__all__ if name not in named]
    assert not missing, f"README.md's Public API does not name {missing}"


LINK = re.compile(r"\]\(([^)\s]+)\)")
# pages linked before they exist, each written by the work that its link describes; a
# link to one is reported as a skip until the page lands, then checked like any other
PENDING = {ROOT / "docs" / "guide" / "rl-colocation.md": "the RL colocation guide"}


def anchors_of(page: Path) -> set[str]:
    """GitHub's heading anchors: lower case, punctuation dropped, spaces as hyphens."""
    found, fenced = set(), False
    for line in page.read_text().splitlines():
        if line.strip().startswith("```"):
            fenced = not fenced
        elif not fenced and line.startswith("#"):
            title = line.lstrip("#").strip().lower()
            found.add(re.sub(r"[^\w\- ]", "", title).replace(" ", "-"))
    return found


@pytest.mark.parametrize("page", PAGES, ids=[str(p.relative_to(ROOT)) for p in PAGES])
def test_relative_links_resolve(page: Path):
    pending = []
    for target in LINK.findall(page.read_text()):
        if re.match(r"^[a-z]+:", target) or target.startswith("<"):
            continue  # a URL
        path, _, anchor = target.partition("#")
        resolved = (page.parent / path).resolve() if path else page
        if not resolved.exists() and resolved in PENDING:
            pending.append(f"{target} ({PENDING[resolved]})")
            continue
        assert resolved.exists(), f"{page.name}: link to {target}: no such file"
        if anchor and resolved.suffix == ".md":
            assert anchor in anchors_of(resolved), f"{page.name}: link to {target}: no such heading"
    if pending:
        pytest.skip(
            f"{page.relative_to(ROOT)}: links to pages not written yet: {', '.join(pending)}"
        )
