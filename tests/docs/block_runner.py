"""Runs the documentation's code blocks for tests/docs/test_code_blocks.py.

Importing torch, hetstore, transformers and Lightning takes 2-7 s, longer than most
blocks run, so this process imports them once and forks one child per block: each child
starts from a process that has imported them and done nothing else (no tensor op, no
thread, no CUDA), changes to the block's directory and runs the block's file as
``__main__`` in a fresh namespace, so a block still fails on a name it does not import
or define. A block cannot see another's state.

Protocol, one JSON object per line: it prints ``{"ready": [modules]}`` once the imports
are done, then reads ``{"script", "cwd", "stdout", "stderr", "timeout"}`` requests from
stdin and answers each with ``{"returncode": N}`` (124 when the child ran past the
timeout and was killed). Started with the modules to import as arguments.
"""

from __future__ import annotations

import atexit
import importlib
import io
import json
import os
import runpy
import signal
import sys
import time
import traceback


def run_child(request: dict) -> int:
    os.chdir(request["cwd"])
    for fd, name in ((1, "stdout"), (2, "stderr")):
        target = os.open(request[name], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(target, fd)
        os.close(target)
    sys.stdout = io.TextIOWrapper(io.FileIO(1, "w", closefd=False), line_buffering=True)
    sys.stderr = io.TextIOWrapper(io.FileIO(2, "w", closefd=False), line_buffering=True)
    sys.stdin = io.StringIO()
    sys.argv = [request["script"]]
    sys.path.insert(0, request["cwd"])
    code = 0
    try:
        runpy.run_path(request["script"], run_name="__main__")
    except SystemExit as stop:
        code = stop.code if isinstance(stop.code, int) else (0 if stop.code is None else 1)
    except BaseException:
        traceback.print_exc()
        code = 1
    try:
        atexit._run_exitfuncs()  # what a script's normal exit runs (hetstore's cleanup)
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
    return code


def wait(pid: int, timeout: float) -> int:
    deadline = time.monotonic() + timeout
    while True:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            return os.waitstatus_to_exitcode(status)
        if time.monotonic() > deadline:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            return 124
        time.sleep(0.02)


def main() -> None:
    loaded = []
    for name in sys.argv[1:]:
        try:
            importlib.import_module(name)
            loaded.append(name)
        except ImportError:
            pass  # a block that needs it fails on its own import, as a user's would
    answer = sys.stdout
    print(json.dumps({"ready": loaded}), file=answer, flush=True)
    for line in sys.stdin:
        request = json.loads(line)
        pid = os.fork()
        if pid == 0:
            code = 1
            try:
                code = run_child(request)
            finally:
                os._exit(code)
        print(json.dumps({"returncode": wait(pid, request["timeout"])}), file=answer, flush=True)


if __name__ == "__main__":
    main()
