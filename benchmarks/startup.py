"""Wall time of the refusals a user meets first: ``python -m distlm.train --help``, a
mistyped flag, an unknown arch, an unknown choice (``--strategy nonsense``), a value out of its
range and a flag of another model family (a bad combination), beside the interpreter's own
start (the floor) and ``import torch`` (the cost they avoid).

    python benchmarks/startup.py --rounds 7
    python benchmarks/startup.py --rounds 7 --repo . --repo ../other-checkout   # compare checkouts

Each command runs as a fresh process in ``--repo`` (default: the checkout this script is in),
with that directory first on the path, as ``python -m`` from a checkout's root imports it.
Each round runs every command of every checkout once, in an order rotated round by round
(this machine is shared, so the contenders interleave and the report gives medians). A
command's time is from the start of its process to its exit, as a user waits for it. Prints
one JSON object: per checkout and command the median, minimum and maximum seconds and the exit
statuses seen, whether every ``distlm.train`` command's median came under the goal of 1 s
(``goal_met``), and the machine's load average when the runs ended.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

COMMANDS = {
    "python_itself": ["-c", "pass"],
    "import_torch": ["-c", "import torch"],
    "train_help": ["-m", "distlm.train", "--help"],
    "train_mistyped_flag": ["-m", "distlm.train", "--max-updat", "10"],
    "train_unknown_arch": ["-m", "distlm.train", "--arch", "robrta_base"],
    "train_out_of_range": ["-m", "distlm.train", "--lr", "-1"],
    "train_unknown_choice": ["-m", "distlm.train", "--strategy", "nonsense"],
    "train_other_family_flag": ["-m", "distlm.train", "--arch", "llama_tiny", "--encoder-layers", "2"],
}

GOAL_S = 1.0
"""``--help`` and every refusal should answer within this many seconds (medians)."""


def main() -> None:
    """Time every command of every checkout, interleaved, and print the JSON report."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=7, help="runs of each command (default 7)")
    parser.add_argument("--repo", action="append", help="a distlm checkout to time (repeatable; default: this one)")
    args = parser.parse_args()
    repos = [str(Path(repo).resolve()) for repo in args.repo or [Path(__file__).resolve().parent.parent]]
    runs = [(repo, name) for repo in repos for name in COMMANDS]
    times: dict[tuple[str, str], list[float]] = {run: [] for run in runs}
    statuses: dict[tuple[str, str], set[int]] = {run: set() for run in runs}
    for round_index in range(args.rounds):
        shift = round_index % len(runs)
        for repo, name in runs[shift:] + runs[:shift]:
            env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": repo}
            started = time.perf_counter()
            done = subprocess.run([sys.executable, *COMMANDS[name]], cwd=repo, env=env, capture_output=True,
                                  timeout=600, check=False)  # refusals exit 2: statuses are reported
            times[repo, name].append(time.perf_counter() - started)
            statuses[repo, name].add(done.returncode)
    report: dict = {"commands": {name: " ".join(["python", *command]) for name, command in COMMANDS.items()}}
    for repo in repos:
        report[repo] = {name: {"median_s": round(statistics.median(times[repo, name]), 3),
                               "min_s": round(min(times[repo, name]), 3), "max_s": round(max(times[repo, name]), 3),
                               "exit_status": sorted(statuses[repo, name])} for name in COMMANDS}
    report["goal"] = f"every train_* median under {GOAL_S} s"
    report["goal_met"] = all(report[repo][name]["median_s"] < GOAL_S
                             for repo in repos for name in COMMANDS if name.startswith("train_"))
    report["rounds"] = args.rounds
    report["load_average_1min"] = round(os.getloadavg()[0], 2)
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
