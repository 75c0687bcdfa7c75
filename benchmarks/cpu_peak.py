"""The CPU peak FLOP/s probe under a competing load: distlm's probe against a wall-clock one.

    python benchmarks/cpu_peak.py [--rounds 5] [--threads 2]

distlm's probe (``distlm.backends.hardware.measure_cpu_matmul_flops``) times each matmul by
the calling thread's CPU clock on one intra-op thread and multiplies by the threads. The
wall-clock probe is what distlm ran before: the best wall time of matmuls on all the threads.
Each round measures both quiet and beside one spinning process per core, interleaved; the
JSON gives each figure's median and the loaded/quiet ratios.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import subprocess
import sys
import time

import torch

from distlm.backends.hardware import host_cores, measure_cpu_matmul_flops


def wall_clock_probe(threads: int, size: int = 512, min_seconds: float = 0.2) -> float:
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        a, b = torch.randn(size, size), torch.randn(size, size)
        torch.mm(a, b)
        best, spent, calls = math.inf, 0.0, 0
        while calls < 2 or spent < min_seconds:
            start = time.perf_counter()
            torch.mm(a, b)
            elapsed = time.perf_counter() - start
            best, spent, calls = min(best, elapsed), spent + elapsed, calls + 1
    finally:
        torch.set_num_threads(previous)
    return 2.0 * size**3 / best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--threads", type=int, default=host_cores())
    args = parser.parse_args()
    probes = {
        "thread_clock": lambda: measure_cpu_matmul_flops.__wrapped__("fp32", threads=args.threads),
        "wall_clock": lambda: wall_clock_probe(args.threads),
    }
    results: dict[str, list[float]] = {f"{name}_{load}": [] for name in probes for load in ("quiet", "loaded")}
    for _ in range(args.rounds):
        for name, probe in probes.items():
            results[f"{name}_quiet"].append(probe())
        spinners = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(host_cores())]
        try:
            time.sleep(0.1)
            for name, probe in probes.items():
                results[f"{name}_loaded"].append(probe())
        finally:
            for spinner in spinners:
                spinner.kill()
                spinner.wait()
    medians = {key: statistics.median(values) / 1e9 for key, values in results.items()}
    print(json.dumps({
        "benchmark": "cpu_peak", "threads": args.threads, "cores": host_cores(), "rounds": args.rounds,
        "torch": torch.__version__,
        "median_gflops": {key: round(value, 1) for key, value in medians.items()},
        "loaded_over_quiet": {name: round(medians[f"{name}_loaded"] / medians[f"{name}_quiet"], 3) for name in probes},
        "loaded_over_quiet_per_round": {
            name: [round(l / q, 3) for q, l in zip(results[f"{name}_quiet"], results[f"{name}_loaded"])] for name in probes
        },
    }, indent=1))


if __name__ == "__main__":
    main()
