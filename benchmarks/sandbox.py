"""Per-call latency of the sandboxed Python tool: a kernel-isolated call vs a fresh ``python -c`` process.

Run: .venv/bin/python benchmarks/sandbox.py [--calls 50] [--gap-ms 20] [--device cpu]

Every row runs the same trivial code (``x = 1``) and reports the median wall-clock time per call and its ratio to
the isolated warm call. "Warm" calls come ``--gap-ms`` apart, as tool calls do between a model's turns (the zygote
has its next isolated process ready); "back to back" calls come with no gap, so each also waits for the next
isolated process to be prepared. No model runs: ``--device`` only labels the table.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time
import warnings

from _device import add_device_argument, device_label, setup_device

from chatenv.tools.sandbox import PythonSandbox


def sandbox_calls(calls: int, gap_s: float, isolation: str) -> list[float]:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # isolation="none" warns on purpose
        sandbox = PythonSandbox(workers=1, isolation=isolation)
    with sandbox:
        workdir = sandbox.new_workdir()
        sandbox.run("x = 1", workdir=workdir)
        times = []
        for _ in range(calls):
            time.sleep(gap_s)
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
    parser.add_argument("--gap-ms", type=float, default=20.0)
    add_device_argument(parser)
    args = parser.parse_args()
    device = setup_device(parser, args)
    gap = args.gap_ms / 1000
    warm = statistics.median(sandbox_calls(args.calls, gap, "namespaces"))
    rows = [
        ("namespaces, warm (PythonSandbox.run)", warm),
        ("namespaces, back to back", statistics.median(sandbox_calls(args.calls, 0.0, "namespaces"))),
        ('isolation="none", warm', statistics.median(sandbox_calls(args.calls, gap, "none"))),
        ("fresh `python -I -c` process (no isolation)", statistics.median(fresh_calls(args.calls, isolated=True))),
    ]
    print(
        f"median per-call latency, {args.calls} calls each, trivial code (`x = 1`), warm: {args.gap_ms:g} ms gaps, "
        f"{device_label(device, threads=False)}\n"
    )
    print(f"| {'how':<44} | {'median ms':>9} | {'× warm':>7} |")
    print(f"|{'-' * 46}|{'-' * 11}|{'-' * 9}|")
    for name, seconds in rows:
        print(f"| {name:<44} | {seconds * 1000:>9.2f} | {seconds / warm:>7.1f} |")


if __name__ == "__main__":
    main()
