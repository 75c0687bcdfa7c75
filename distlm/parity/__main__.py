"""``python -m distlm.parity``: does a layout train as one process does, and where does it not?

    python -m distlm.parity --layouts "strategy=ddp,dp=2" "strategy=fsdp,dp=2" "tp=2,sequence_parallel=true" \\
        --steps 2 --activations --arch llama_tiny --batch-size 2 --tokens-per-sample 32 --out parity/

The same ``--steps`` updates run from the same initial weights on the same global
batches, once in one process (the reference) and once per layout, with dropout off and
deterministic algorithms. Every other flag is distlm.train's and applies to all runs
(``--config run.toml`` too); a layout's keys are added to them (distlm/parity/layouts.py).
The reference takes the global batch as ``--update-freq`` x dp micro-batches of
``--batch-size``, so its micro-batch j is the one data-parallel rank j / U trains on. A
mixture of experts with an auxiliary loss is the exception: that loss is taken over the
global micro-batch (every rank's j-th, distlm/models/moe/model.py), so its reference trains on
micro-batches of dp x ``--batch-size``, which exist for ``--update-freq`` 1 only.
On one machine each layout is a ``torchrun --standalone`` of its world size; inside an
allocation (torchrun, srun, mpiexec) every layout runs on the allocation's ranks, which
must be its world size, and rank 0 runs the reference as a process of its own first.
On one machine a layout may start at most ``--max-ranks`` processes (default: twice the
cores this process may run on); a layout needing more is refused before anything starts.

``--out`` receives parity.json, parity.md (the table) and each run's recordings. The
exit status is 0 when every layout equals the reference within its tolerance, 1 when
one does not, 2 on bad input.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Sequence

from distlm.backends.hardware import host_cores
from distlm.config import OneLineErrorParser
from distlm.config import parse_args as parse_train_args
from distlm.errors import UsageError, rank_from_environment, report_usage_error
from distlm.launch.cluster_env import ClusterEnv
from distlm.launch.detect import detect_launch
from distlm.parity import compare
from distlm.parity.layouts import Layout, check_layout, parse_layout
from distlm.parity.worker import ERROR_PREFIX, model_builder
from distlm.parity.worker import main as run_worker_here
from distlm.training.builder import resolve_model_spec

REFERENCE = "reference"
# Environment variables of launchers, removed for the reference's own process.
_LAUNCH_VARIABLES = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "MASTER_ADDR",
                     "MASTER_PORT", "TORCHELASTIC_RUN_ID", "TORCHELASTIC_USE_AGENT_STORE", "TORCHELASTIC_RESTART_COUNT")
_LAUNCH_PREFIXES = ("SLURM_", "OMPI_", "PMI_", "PMIX_")
# Processes per core a layout may start on one machine by default: two ranks a core still
# finish a few updates of a small model, while every rank also holds its own torch (hundreds
# of MB), so many more exhaust the memory before they are slow.
RANKS_PER_CORE = 2


def build_parser() -> OneLineErrorParser:
    parser = OneLineErrorParser(prog="python -m distlm.parity", allow_abbrev=False,
                                description="Compare layouts against one process, update by update.")
    parser.add_argument("--layouts", nargs="+", required=True, metavar="LAYOUT",
                        help='layouts as key=value lists, e.g. "strategy=fsdp,dp=2" "tp=2,sequence_parallel=true"')
    parser.add_argument("--steps", type=int, default=2, help="updates to compare (default 2)")
    parser.add_argument("--out", required=True, help="directory for parity.json, parity.md and the recordings")
    parser.add_argument("--activations", action="store_true",
                        help="also compare every top-level module's and block's output and input gradient")
    parser.add_argument("--model", metavar="PACKAGE.MODULE:FUNCTION",
                        help="train the model this function returns (it meets distlm's model contract)")
    parser.add_argument("--max-ranks", type=int, default=None, metavar="N",
                        help=f"most processes a layout may start on this machine (default: {RANKS_PER_CORE} per "
                             "core); inside a launch the launcher's ranks run every layout")
    return parser


def parse_args(argv: Sequence[str]) -> tuple[argparse.Namespace, list[str]]:
    """The tool's own options, and distlm.train's flags for every run."""
    args, train_flags = build_parser().parse_known_args(list(argv))
    if args.steps < 1:
        raise UsageError(f"--steps must be at least 1, got {args.steps}")
    if args.max_ranks is not None and args.max_ranks < 1:
        raise UsageError(f"--max-ranks must be at least 1, got {args.max_ranks}")
    for flag in ("--max-update", "--save-dir", "--restore-file", "--num-workers", "--double-buffering"):
        if any(item == flag or item.startswith(flag + "=") for item in train_flags):
            raise UsageError(f"{flag} is set by the parity run itself (or is a layout key); drop it")
    args.layouts = [parse_layout(text) for text in args.layouts]
    piped = [layout.text for layout in args.layouts if "--pp-degree" in layout.flags]
    if args.activations and piped:
        # A stage runs its own micro-batches, so its hooks see other slices of the batch
        # than the reference's micro-batches; parameters, losses and norms still compare.
        raise UsageError(f"--activations does not record pipeline stages (layout {piped[0]!r}); "
                         "compare that layout without --activations")
    names = [layout.name for layout in args.layouts]
    if len(set(names)) != len(names) or REFERENCE in names:
        raise UsageError("two layouts are the same; give each once")
    return args, train_flags


def check_rank_limit(layouts: list[Layout], max_ranks: int | None) -> None:
    """Refuse a layout that would start more processes on this machine than ``max_ranks``
    (default RANKS_PER_CORE per core)."""
    cores = host_cores()
    limit = RANKS_PER_CORE * cores if max_ranks is None else max_ranks
    for layout in layouts:
        if layout.world_size > limit:
            default = f" ({RANKS_PER_CORE} per core x {cores} cores)" if max_ranks is None else ""
            raise UsageError(f"layout {layout.text!r} starts {layout.world_size} processes, more than the limit of "
                             f"{limit}{default}; lower its degrees, or raise the limit with --max-ranks "
                             f"{layout.world_size}")


def run_flags(train_flags: list[str], steps: int) -> list[str]:
    """distlm.train's flags common to every run: the user's, then what parity needs."""
    return [*train_flags, "--max-update", str(steps), "--no-save", "--disable-validation", "--log-interval", "1",
            "--num-workers", "0", "--dropout", "0", "--attention-dropout", "0", "--log-format", "json"]


def reference_flags(flags: list[str], layout: Layout) -> list[str]:
    """One process in the layout's precision on its global batch: U x dp micro-batches
    of its --batch-size, or a mixture of experts' global micro-batches (``global_micro_batch``)."""
    config = parse_train_args(flags + layout.flags)
    dp = layout.world_size // (config.distributed.tp_degree * getattr(config.distributed, "pp_degree", 1))
    stale = ["--double-buffering"] if config.distributed.double_buffering and dp > 1 else []
    ranks = global_micro_batch(flags, layout)
    return [*flags, *layout.precision_flags, "--batch-size", str(config.data.batch_size * ranks),
            "--update-freq", str(config.data.update_freq * dp // ranks), *stale]


def global_micro_batch(flags: list[str], layout: Layout) -> int:
    """How many data-parallel ranks' micro-batches a reference micro-batch holds: dp for a
    mixture of experts with an auxiliary loss, whose routing statistics are those of every
    rank's j-th micro-batch together; 1 otherwise (a model of the user's own: 1)."""
    config = parse_train_args(flags + layout.flags)
    dp = layout.world_size // (config.distributed.tp_degree * getattr(config.distributed, "pp_degree", 1))
    if dp == 1 or (config.model.arch is None and config.model.init_from_hf is None):
        return 1
    coefficient = config.model.moe_aux_loss_coef
    if coefficient is None:
        coefficient = getattr(resolve_model_spec(config.model).config, "aux_loss_coef", 0.0)
    if not coefficient:
        return 1
    if config.data.update_freq > 1:
        raise UsageError(
            f"layout {layout.text!r}: a mixture of experts' aux loss is taken over each global micro-batch (every "
            f"rank's j-th), which no one process reproduces with --update-freq {config.data.update_freq}: its j-th "
            "micro-batch holds other samples; compare with update_freq=1, or with --moe-aux-loss-coef 0")
    return dp


def layout_config(flags: list[str], layout: Layout):
    return parse_train_args(flags + layout.flags)


def write_spec(directory: Path, flags: list[str], args: argparse.Namespace, stale: bool = False) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    spec = directory / "spec.json"
    spec.write_text(json.dumps({"flags": flags, "model": args.model, "out": str(directory),
                                "activations": args.activations, "stale_reference": stale}, indent=1))
    return spec


def launch(spec: Path, world_size: int, log: Path) -> None:
    """One run on this machine: plain Python for one process, torchrun for more."""
    command = [sys.executable, "-m", "distlm.parity.worker", str(spec)]
    if world_size > 1:
        command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(world_size), "--standalone",
                   "-m", "distlm.parity.worker", str(spec)]
    package_root = str(Path(__file__).resolve().parents[2])
    env = {key: value for key, value in os.environ.items()
           if key not in _LAUNCH_VARIABLES and not key.startswith(_LAUNCH_PREFIXES)}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [package_root, env.get("PYTHONPATH")]))
    with open(log, "w") as out:
        status = subprocess.run(command, stdout=out, stderr=subprocess.STDOUT, env=env).returncode
    text = log.read_text()
    if ERROR_PREFIX in text:
        raise UsageError(text.split(ERROR_PREFIX, 1)[1].splitlines()[0].strip())
    if status != 0:
        raise RuntimeError(f"the run failed (exit status {status}); its output is in {log}")


def run_all(args: argparse.Namespace, flags: list[str], env: ClusterEnv) -> dict[str, Path]:
    """The reference and every layout; their recording directories by name."""
    out = Path(args.out)
    in_place = env.launcher != "single"
    directories: dict[str, Path] = {}
    references: dict[tuple[str, ...], Path] = {}
    for layout in args.layouts:
        ref_flags = reference_flags(flags, layout)
        key = tuple(ref_flags)
        if key not in references:
            directory = out / f"{REFERENCE}{len(references) or ''}"
            references[key] = directory
            if env.rank == 0:
                _say(f"reference: one process, {' '.join(ref_flags[len(flags):]) or 'the run flags'}")
                spec = write_spec(directory, ref_flags, args, stale="--double-buffering" in ref_flags)
                launch(spec, 1, directory / "run.log")
            if in_place:
                _wait_for(directory / "steps.jsonl", args.steps)
        directories[f"ref:{layout.name}"] = references[key]
        directory = out / layout.name
        spec = write_spec(directory, flags + layout.flags, args) if env.rank == 0 or in_place else None
        _say(f"layout {layout.describe()}")
        if in_place:
            if run_worker_here([str(spec)]) != 0:
                raise UsageError(f"layout {layout.text!r} failed; see the messages above")
        else:
            launch(spec, layout.world_size, directory / "run.log")
        directories[layout.name] = directory
    return directories


def _wait_for(path: Path, steps: int, timeout_s: float = 3600.0) -> None:
    """Rank 0 runs the reference; the others wait for its last step on the shared --out."""
    deadline = time.monotonic() + timeout_s
    while not (path.is_file() and len(path.read_text().splitlines()) >= steps):
        if time.monotonic() > deadline:
            raise RuntimeError(f"the reference did not finish within {timeout_s:.0f} s ({path} is incomplete); "
                               "--out must be on a file system every rank shares")
        time.sleep(1.0)


def verdicts(args: argparse.Namespace, flags: list[str], directories: dict[str, Path]) -> dict:
    results = []
    for layout in args.layouts:
        config = layout_config(flags, layout)
        tolerance = compare.tolerance_for(config.precision_mode, config.distributed.comm_hook)
        rows = compare.compare_run(directories[f"ref:{layout.name}"], directories[layout.name], args.steps,
                                   args.activations, tolerance, global_micro_batch(flags, layout))
        where = compare.first_divergence(rows, tolerance)
        stale = " (against a reference whose every update applies the previous update's gradients, as double " \
                "buffering does)" if config.distributed.double_buffering else ""
        verdict = (f"{layout.text}: equal to one process for {args.steps} updates within {tolerance.describe()}{stale}"
                   if where is None else
                   f"{layout.text}: differs from one process at {where}, beyond {tolerance.describe()}{stale}")
        results.append({"layout": layout.text, "world_size": layout.world_size, "flags": layout.flags,
                        "tolerance": tolerance.value, "tolerance_reason": tolerance.describe(),
                        "equal": where is None, "first_difference": where, "verdict": verdict,
                        "steps": [row.__dict__ for row in rows]})
    return {"steps": args.steps, "run_flags": flags, "model": args.model, "activations": args.activations,
            "layouts": results}


def _say(line: str) -> None:
    if rank_from_environment() == 0:
        print(f"distlm.parity| {line}", file=sys.stderr, flush=True)


def main(argv: Sequence[str] | None = None) -> int:
    rank = rank_from_environment()
    try:
        args, train_flags = parse_args(sys.argv[1:] if argv is None else argv)
        flags = run_flags(train_flags, args.steps)
        parse_train_args(flags)
        if args.model:
            model_builder(args.model)
        for layout in args.layouts:
            check_layout(layout, flags)
            global_micro_batch(flags, layout)  # refuses a reference no one process can be
        env = detect_launch()
        if env.launcher == "single":
            check_rank_limit(args.layouts, args.max_ranks)
        else:
            wrong = [layout.text for layout in args.layouts if layout.world_size != env.world_size]
            if wrong:
                raise UsageError(f"inside a launch of {env.world_size} ranks every layout runs on them; "
                                 f"{', '.join(wrong)} need{'s' if len(wrong) == 1 else ''} another world size")
        out = Path(args.out)
        if out.exists() and not out.is_dir():
            raise UsageError(f"--out {out} is a file; give a directory for the recordings and parity.json")
        if rank == 0:
            # Recordings of an earlier run (another world size's rank files) must not be merged.
            for stale in [*out.glob(f"{REFERENCE}*"), *(out / layout.name for layout in args.layouts)]:
                shutil.rmtree(stale, ignore_errors=True)
        out.mkdir(parents=True, exist_ok=True)
        directories = run_all(args, flags, env)
    except UsageError as exc:
        return report_usage_error(ERROR_PREFIX, exc, rank)
    except RuntimeError as exc:
        # A run that failed for another reason: its log is named, the verdict cannot be given.
        print(f"{ERROR_PREFIX}{exc}", file=sys.stderr, flush=True)
        return 1
    if rank != 0:
        return 0
    report = verdicts(args, flags, directories)
    (out / "parity.json").write_text(json.dumps(report, indent=1))
    table = compare.markdown_table(report["layouts"])
    (out / "parity.md").write_text(table)
    print(table)
    for result in report["layouts"]:
        print(result["verdict"])
    return 0 if all(result["equal"] for result in report["layouts"]) else 1


if __name__ == "__main__":
    sys.exit(main())
