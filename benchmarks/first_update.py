"""Wall time from launching a training command to its first update, distlm against torchtitan,
on torchtitan's llama3 debug model under torchrun.

    python benchmarks/first_update.py --rounds 5 --ranks 1 2
    python benchmarks/first_update.py --rounds 5 --ranks 1 2 --base ../distlm-before   # and another checkout

Each contender is one command, started as a user starts it; its time is from the launch of
``torchrun`` to the moment its first training update's log line reaches this script (its exit
status is reported beside, as gloo processes can abort while their interpreter exits):

* ``distlm``: ``torchrun -m distlm.train`` with ``--arch llama_tiny`` and the size flags that make
  torchtitan's debugmodel (6 layers, width 256, 16 heads and 16 KV heads, FFN 768, vocabulary
  2,048, rope theta 500,000 with llama3 scaling: 6,163,712 parameters), ``--max-update 1``.
* ``torchtitan``: ``torchrun benchmarks/torchtitan_cpu.py --module llama3 --config
  llama3_debugmodel`` in torchtitan's own virtual environment (``--torchtitan-venv``), one step.
* ``floor``: ``torchrun --no-python python -c "import torch"``, what any torch program launched
  by torchrun pays before its own first line.
* ``distlm_base`` with ``--base DIR``: the distlm command run from another checkout (the commit
  before a start-up change), to measure the change beside the rest.

Both train in fp32 on the same text with the same tokenizer: the standard library's prose (as
distlm's built-in corpus gathers it) written once as JSON lines, and a 2,048-token BPE that
``python -m distlm.prepare`` trains on it. distlm reads the prepared token files; torchtitan
reads the JSON lines through its ``c4_test`` loader and tokenizes as it goes (its own way).
Both pack documents into full blocks of ``--tokens-per-sample`` with ``--batch-size`` blocks per
rank, without activation checkpointing (the debugmodel's selective checkpointing is turned off,
as distlm runs without one), with FSDP at 2 ranks (torchtitan's default; distlm's
``--strategy fsdp``) and the debugmodel's optimizer: AdamW at 8e-4, betas (0.9, 0.95), weight
decay 0.1, clipping at 1.0. torchtitan's FSDP computes in bf16 unless told otherwise, at one
rank too (its mixed-precision policy is installed on a mesh of one), so it is given
``--training.mixed-precision-param float32``. Every rank runs ``cores / ranks`` intra-op threads.

One untimed run of each contender first warms the caches a second launch would find (Python's
bytecode, the page cache, the datasets library's Arrow cache of the text). Then each round runs
every contender once at every rank count, in an order rotated round by round, so that the
machine's load falls on all alike; the report gives medians and the ratios distlm / torchtitan,
of the medians and per round, and of the medians less the floor's (what each program adds to the
launch both pay). distlm's time is broken down by its own log lines' timestamps
(``phases``): launch to its launcher line (torchrun, Python, imports, validation, the process
group), to its model line (data and model built), to the start of the first update (optimizer,
sampler, run statistics, first batch), and the first update itself (its ``train_wall``).
torchtitan's likewise: to its version line (imports), to "Training starts" and to step 1. Last,
one run of each program's rank-0 work under ``python -X importtime`` (one process, no torchrun)
gives the imports' total and the largest of them; that profiler inflates them.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path

from distlm.backends.hardware import cpu_model_and_flags

REPO = Path(__file__).resolve().parent.parent
TORCHTITAN_WRAPPER = REPO / "benchmarks" / "torchtitan_cpu.py"

DEBUGMODEL_FLAGS = [
    "--arch", "llama_tiny", "--decoder-layers", "6", "--decoder-embed-dim", "256", "--decoder-attention-heads", "16",
    "--kv-heads", "16", "--multiple-of", "256", "--vocab-size", "2048", "--rope-theta", "500000",
    "--rope-scaling", "llama3", "--rope-factor", "8", "--rope-low-freq-factor", "1", "--rope-high-freq-factor", "4",
    "--rope-original-max-seq-len", "8192",
]
"""torchtitan's llama3 debugmodel as distlm's flags (tests/test_model_sizing.py checks its 6,163,712 parameters)."""

DEBUGMODEL_OPTIMIZER = ["--lr", "8e-4", "--warmup-updates", "2", "--adam-betas", "(0.9,0.95)", "--weight-decay", "0.1",
                        "--clip-norm", "1.0"]

GOAL_RATIO = 0.5
"""The goal: distlm's median launch-to-first-update at most this fraction of torchtitan's (``goal_met``)."""

DISTLM_FIRST_UPDATE = re.compile(r'^\{"kind": "train", "update": 1,')
TORCHTITAN_FIRST_UPDATE = re.compile(r"step:\s+1\s")
FLOOR_DONE = re.compile(r"^floor done$")
ANSI_ESCAPE = re.compile(r"\x1b\[[0-9;]*m")
LOG_TIME = re.compile(r"(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3})")

DISTLM_MILESTONES = {"launcher_line": re.compile(r"\| distlm \| launcher "),
                     "model_line": re.compile(r"\| distlm \| model: ")}
TORCHTITAN_MILESTONES = {"version_line": re.compile(r"torchtitan version"),
                         "training_starts": re.compile(r"Training starts at step 1")}


@dataclass
class Run:
    """One launch: seconds to the first update's line, and every line with the wall-clock time it arrived."""

    first_update_s: float | None
    launched_at: float
    lines: list[tuple[float, str]] = field(default_factory=list)
    status: int | None = None


def launch(command: list[str], env: dict[str, str], cwd: Path, first_update: re.Pattern, timeout: float) -> Run:
    """Start ``command`` and read its merged output as it comes, until it exits."""
    launched_at = time.time()
    started = time.perf_counter()
    process = subprocess.Popen(command, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                               text=True, bufsize=1, start_new_session=True)
    # A timer, not a check per line: a launch that hangs silently writes no line to check at.
    # The command has its own session, so the kill reaches torchrun and its workers.
    watchdog = threading.Timer(timeout, os.killpg, (process.pid, 9))
    watchdog.start()
    run = Run(None, launched_at)
    assert process.stdout is not None
    try:
        for raw in process.stdout:
            line = ANSI_ESCAPE.sub("", raw.rstrip("\n"))
            run.lines.append((time.time(), line))
            if run.first_update_s is None and first_update.search(line):
                run.first_update_s = time.perf_counter() - started
        run.status = process.wait()
    finally:
        watchdog.cancel()
    # Only a launch that never reached its first update is a failure here: a gloo process can
    # abort as its interpreter exits, after all its work (its status is reported, not timed).
    if run.first_update_s is None:
        tail = "\n".join(line for _, line in run.lines[-30:])
        raise RuntimeError(f"{' '.join(command)} ended with status {run.status} without its first update:\n{tail}")
    return run


def log_time(line: str) -> float | None:
    """The wall-clock time a log line was written (distlm's and torchtitan's asctime, local time)."""
    found = LOG_TIME.search(line)
    return datetime.strptime(found.group(1), "%Y-%m-%d %H:%M:%S,%f").timestamp() if found else None


def milestone_times(run: Run, milestones: dict[str, re.Pattern]) -> dict[str, float]:
    """Seconds from the launch to the first line matching each milestone, by the line's own timestamp."""
    found: dict[str, float] = {}
    for _, line in run.lines:
        for name, pattern in milestones.items():
            written = log_time(line)
            if name not in found and pattern.search(line) and written is not None:
                found[name] = written - run.launched_at
    return found


def distlm_phases(run: Run) -> dict[str, float]:
    """distlm's start-up by its own log lines and the first update's ``train_wall``."""
    at = milestone_times(run, DISTLM_MILESTONES)
    first_line = next(line for _, line in run.lines if DISTLM_FIRST_UPDATE.search(line))
    update_s = json.loads(first_line)["train_wall"]
    assert run.first_update_s is not None
    update_starts = run.first_update_s - update_s
    return {"launch_to_launcher_line": at["launcher_line"],
            "data_and_model": at["model_line"] - at["launcher_line"],
            "until_first_update_starts": update_starts - at["model_line"],
            "first_update": update_s}


def torchtitan_phases(run: Run) -> dict[str, float]:
    """torchtitan's start-up by its log lines: imports, building, the first step."""
    at = milestone_times(run, TORCHTITAN_MILESTONES)
    assert run.first_update_s is not None
    return {"launch_to_version_line": at["version_line"],
            "until_training_starts": at["training_starts"] - at["version_line"],
            "first_step": run.first_update_s - at["training_starts"]}


def write_text(out: Path) -> int:
    """The standard library's prose as JSON lines (``{"text": ...}``), as the built-in corpus keeps
    it (duplicates and non-prose dropped); the number of documents."""
    sys.path.insert(0, str(REPO))  # this checkout's distlm, as the commands timed import it
    from distlm.data.corpus import iter_stdlib_paragraphs, looks_like_prose

    seen: set[str] = set()
    with out.open("w") as f:
        for _, paragraph in iter_stdlib_paragraphs():
            if paragraph not in seen and looks_like_prose(paragraph):
                seen.add(paragraph)
                f.write(json.dumps({"text": paragraph}) + "\n")
    return len(seen)


def prepare_data(work: Path, env: dict[str, str]) -> tuple[Path, Path, dict]:
    """The text for torchtitan (a directory its ``c4_test`` loader reads) and distlm's prepared
    data with the 2,048-token tokenizer both use; and what it took."""
    text_dir = work / "text"
    text_dir.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    documents = write_text(text_dir / "data.jsonl")
    prepared = work / "prepared"
    subprocess.run([sys.executable, "-m", "distlm.prepare", "--input", str(text_dir / "data.jsonl"), "--out",
                    str(prepared), "--vocab-size", "2048"], env=env, check=True, capture_output=True)
    return text_dir, prepared, {"documents": documents, "seconds": round(time.perf_counter() - started, 1)}


def distlm_command(ranks: int, data: Path, args: argparse.Namespace) -> list[str]:
    """torchrun of ``distlm.train`` on the debugmodel for one update (FSDP from 2 ranks)."""
    strategy = ["--strategy", "fsdp"] if ranks > 1 else []
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(ranks),
            "-m", "distlm.train", "--data", str(data), *DEBUGMODEL_FLAGS, *DEBUGMODEL_OPTIMIZER, *strategy,
            "--batch-size", str(args.batch_size), "--tokens-per-sample", str(args.tokens_per_sample),
            "--sample-break-mode", "none", "--max-update", "1", "--no-save", "--disable-validation",
            "--log-format", "json"]


def torchtitan_command(ranks: int, text: Path, tokenizer: Path, work: Path, args: argparse.Namespace) -> list[str]:
    """torchrun of torchtitan's trainer (through ``torchtitan_cpu.py``) on its debugmodel for one step."""
    python = str(Path(args.torchtitan_venv) / "bin" / "python")
    return [python, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(ranks),
            str(TORCHTITAN_WRAPPER), "--module", "llama3", "--config", "llama3_debugmodel",
            "--parallelism.spmd-backend", "partial_dtensor", "--hf-assets-path", str(tokenizer),
            "--dataloader.dataset-path", str(text), "--training.local-batch-size", str(args.batch_size),
            "--training.seq-len", str(args.tokens_per_sample), "--training.steps", "1",
            "--training.mixed-precision-param", "float32", "--dump-folder", str(work / "torchtitan-outputs"),
            "--metrics.disable-color-printing", "activation-checkpoint:none"]


def floor_command(ranks: int) -> list[str]:
    """torchrun of a process that imports torch and says so: the launch every contender pays."""
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(ranks),
            "--no-python", sys.executable, "-c", "import torch; print('floor done', flush=True)"]


def import_profile(command: list[str], env: dict[str, str], cwd: Path) -> dict:
    """Run one process of ``command`` (rank 0's work, no torchrun) under ``-X importtime``: the
    imports' total seconds and the five largest top-level ones."""
    done = subprocess.run([command[0], "-X", "importtime", *command[1:]], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=600, check=False)  # its status is reported
    top: list[tuple[float, str]] = []
    for line in done.stderr.splitlines():
        found = re.match(r"import time:\s+\d+ \|\s+(\d+) \| (\S.*)$", line)  # no indent: imported at top level
        if found:
            top.append((int(found.group(1)) / 1e6, found.group(2)))
    top.sort(reverse=True)
    return {"total_s": round(sum(seconds for seconds, _ in top), 2),
            "largest": {name: round(seconds, 2) for seconds, name in top[:5]}, "exit_status": done.returncode}


def cpu_description() -> dict:
    """The CPU's model name and the instruction-set flags that decide matmul speed."""
    model, flags = cpu_model_and_flags()
    wanted = ("avx2", "fma", "avx512f", "avx512_bf16", "avx512_fp16", "amx_bf16", "amx_tile")
    return {"model": model or "unknown", "flags": [flag for flag in wanted if flag in flags],
            "cores": len(os.sched_getaffinity(0))}


def summarise(values: list[float]) -> dict:
    """Median, minimum and maximum seconds."""
    return {"median_s": round(statistics.median(values), 3), "min_s": round(min(values), 3),
            "max_s": round(max(values), 3)}


def main() -> None:
    """Prepare the data, warm every contender up, time the rounds and print the JSON report."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5, help="timed runs of each contender (default 5)")
    parser.add_argument("--ranks", type=int, nargs="+", default=[1, 2], help="world sizes (default 1 2)")
    parser.add_argument("--batch-size", type=int, default=4, help="blocks per rank (default 4)")
    parser.add_argument("--tokens-per-sample", type=int, default=512, help="tokens per block (default 512)")
    parser.add_argument("--torchtitan-venv", default="/work/tt-venv",
                        help="virtual environment with torch==2.13.0 and torchtitan==0.3.0 (default /work/tt-venv)")
    parser.add_argument("--base", help="another distlm checkout whose command is timed beside this one's")
    parser.add_argument("--work", help="directory for the data and outputs (default: a temporary one, removed)")
    parser.add_argument("--timeout", type=float, default=300, help="seconds one launch may take (default 300)")
    args = parser.parse_args()

    work = Path(args.work or tempfile.mkdtemp(prefix="first-update-"))
    work.mkdir(parents=True, exist_ok=True)
    cores = len(os.sched_getaffinity(0))
    base_env = {**os.environ, "PYTHONPATH": str(REPO), "HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1",
                "PYTHONUNBUFFERED": "1"}
    checkouts = {"distlm": REPO, **({"distlm_base": Path(args.base).resolve()} if args.base else {})}
    try:
        text, prepared, data = prepare_data(work, base_env)
        contenders: dict[tuple[str, int], tuple[list[str], re.Pattern]] = {}
        for ranks in args.ranks:
            for name in checkouts:
                contenders[name, ranks] = (distlm_command(ranks, prepared, args), DISTLM_FIRST_UPDATE)
            contenders["torchtitan", ranks] = (torchtitan_command(ranks, text, prepared, work, args),
                                               TORCHTITAN_FIRST_UPDATE)
            contenders["floor", ranks] = (floor_command(ranks), FLOOR_DONE)

        def run(key: tuple[str, int]) -> Run:
            command, first_update = contenders[key]
            # Each checkout first on the path, as ``python -m`` in its root would have it.
            path = str(checkouts.get(key[0], REPO))
            env = {**base_env, "PYTHONPATH": path, "OMP_NUM_THREADS": str(max(1, cores // key[1]))}
            return launch(command, env, work, first_update, args.timeout)

        for key in contenders:  # warm-up, untimed
            run(key)
        runs: dict[tuple[str, int], list[Run]] = {key: [] for key in contenders}
        order = list(contenders)
        for round_index in range(args.rounds):
            shift = round_index % len(order)
            for key in order[shift:] + order[:shift]:
                runs[key].append(run(key))

        report: dict = {"what": "seconds from launching torchrun to the first update's log line",
                        "goal": f"distlm_over_torchtitan <= {GOAL_RATIO}",
                        "machine": cpu_description(), "date": time.strftime("%Y-%m-%d"),
                        "rounds": args.rounds, "batch_size_per_rank": args.batch_size,
                        "tokens_per_sample": args.tokens_per_sample, "precision": "fp32", "data": data,
                        "checkouts": {name: str(path) for name, path in checkouts.items()},
                        "commands": {f"{name}_{ranks}": " ".join(command)
                                     for (name, ranks), (command, _) in contenders.items()}}
        for ranks in args.ranks:
            names = [*checkouts, "torchtitan", "floor"]
            times = {name: [r.first_update_s for r in runs[name, ranks]] for name in names}
            ratios = {}
            for name in checkouts:
                ratios[f"{name}_over_torchtitan"] = ratio_of_medians(times[name], times["torchtitan"])
                ratios[f"{name}_over_torchtitan_per_round"] = per_round(times[name], times["torchtitan"])
            ratios["goal_met"] = ratios["distlm_over_torchtitan"] <= GOAL_RATIO
            # What each program adds to the launch both pay (torchrun, Python, torch): the part
            # a program's own start-up decides.
            floor = statistics.median(times["floor"])
            ratios["distlm_over_torchtitan_above_floor"] = round(
                (statistics.median(times["distlm"]) - floor) / (statistics.median(times["torchtitan"]) - floor), 3)
            if args.base:
                ratios["distlm_over_distlm_base"] = ratio_of_medians(times["distlm"], times["distlm_base"])
                ratios["distlm_over_distlm_base_per_round"] = per_round(times["distlm"], times["distlm_base"])
            phases = {**{name: [distlm_phases(r) for r in runs[name, ranks]] for name in checkouts},
                      "torchtitan": [torchtitan_phases(r) for r in runs["torchtitan", ranks]]}
            report[f"ranks_{ranks}"] = {
                **{name: summarise(values) for name, values in times.items()}, **ratios,
                "exit_statuses": {name: sorted({r.status for r in runs[name, ranks]}) for name in names},
                "phases_median_s": {name: {phase: round(statistics.median(p[phase] for p in values), 3)
                                           for phase in values[0]} for name, values in phases.items()},
            }
        # Without torchrun: distlm runs as one plain process; torchtitan reads torchrun's variables.
        one_process = {**base_env, "OMP_NUM_THREADS": str(cores)}
        as_rank_0 = {**one_process, "RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1",
                     "MASTER_PORT": str(29500 + os.getpid() % 1000)}
        launcher_arguments = 6  # python -m torch.distributed.run --standalone --nproc_per_node N
        torchtitan_alone = torchtitan_command(1, text, prepared, work, args)
        report["imports_one_process"] = {
            "distlm": import_profile([sys.executable, *distlm_command(1, prepared, args)[launcher_arguments:]],
                                     one_process, work),
            "torchtitan": import_profile([torchtitan_alone[0], *torchtitan_alone[launcher_arguments:]], as_rank_0,
                                         work),
        }
        report["load_average_1min"] = round(os.getloadavg()[0], 2)
        print(json.dumps(report, indent=2))
    finally:
        if not args.work:
            shutil.rmtree(work, ignore_errors=True)


def ratio_of_medians(numerator: list[float], denominator: list[float]) -> float:
    """median(numerator) / median(denominator)."""
    return round(statistics.median(numerator) / statistics.median(denominator), 3)


def per_round(numerator: list[float], denominator: list[float]) -> list[float]:
    """The ratio within each round, where both ran under the same load."""
    return [round(a / b, 3) for a, b in zip(numerator, denominator)]


if __name__ == "__main__":
    main()
