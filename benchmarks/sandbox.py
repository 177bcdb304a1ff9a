"""Per-call latency of the sandboxed Python tool: a warm worker vs a fresh ``python -c`` process per call.

Run: .venv/bin/python benchmarks/sandbox.py [--calls 50]

Both sides run the same trivial code (``x = 1``); the table shows the median wall-clock time per call and the ratio.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
import time

from chatenv.tools.sandbox import PythonSandbox


def warm_calls(calls: int) -> list[float]:
    with PythonSandbox(workers=1) as sandbox, tempfile.TemporaryDirectory() as workdir:
        sandbox.run("x = 1", workdir=workdir)  # the worker is warm from here on
        times = []
        for _ in range(calls):
            t = time.perf_counter()
            result = sandbox.run("x = 1", workdir=workdir)
            times.append(time.perf_counter() - t)
            assert result.ok, result.text()
        return times


def fresh_calls(calls: int, isolated: bool) -> list[float]:
    argv = [sys.executable, *(["-I"] if isolated else []), "-c", "x = 1"]
    times = []
    for _ in range(calls):
        t = time.perf_counter()
        subprocess.run(argv, check=True, capture_output=True)
        times.append(time.perf_counter() - t)
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--calls", type=int, default=50)
    args = parser.parse_args()
    warm = statistics.median(warm_calls(args.calls))
    rows = [
        ("warm sandbox worker (PythonSandbox.run)", warm),
        ("fresh `python -c` process", statistics.median(fresh_calls(args.calls, isolated=False))),
        ("fresh `python -I -c` process", statistics.median(fresh_calls(args.calls, isolated=True))),
    ]
    print(f"median per-call latency, {args.calls} calls each, trivial code (`x = 1`)\n")
    print(f"| {'how':<42} | {'median ms':>9} | {'× warm':>7} |")
    print(f"|{'-' * 44}|{'-' * 11}|{'-' * 9}|")
    for name, seconds in rows:
        print(f"| {name:<42} | {seconds * 1000:>9.2f} | {seconds / warm:>7.1f} |")


if __name__ == "__main__":
    main()
