"""``python -m distlm.bench scaling``: throughput, step-time split, memory and efficiency over world sizes.

    python -m distlm.bench scaling --arch roberta_tiny --ranks 1,2,4 --strategy ddp,fsdp --mode weak \\
        --steps 10 --batch-size 16 --tokens-per-sample 128 --out scaling/

On one machine the suite starts torchrun itself, once per world size and repetition
(``python -m torch.distributed.run --nproc_per_node N --standalone -m distlm.bench.worker``),
with the same number of threads per rank at every world size. The whole list of world
sizes is repeated ``--repeats`` times, in an order rotated every repetition, and each
point is the median of its repetitions: other work on a shared machine then slows all
points alike instead of one. After each world size N > 1 it also runs N one-rank
launches at once (``run_concurrent``): nothing communicates, and they measure what
sharing the host costs compute and the optimizer step. Inside a launch (torchrun, srun,
mpiexec) it measures that launch's world size in place and merges the points into the
rows already in ``--out``, so a sweep over several allocations collects in one directory.

Each launch reads the 1-minute load average before and after it. Above the cores the suite's
ranks use (ranks x threads per rank; the suite's own earlier launches, which the average
still carries for about a minute, never exceed them), other work shared those cores: the
point is marked ``under_load`` and results.md calls its figures noise.

``--out`` receives results.jsonl (one object per point; the fields are documented in
benchmarks/README.md), results.md, tokens_per_s.png, efficiency.png, step_breakdown.png,
allreduce.jsonl (the collective probe of each multi-rank layout: plain all-reduce,
all-gather and reduce-scatter, each alone), calibration.jsonl (what ``python -m distlm.plan
--calibrate`` should fit to: the one-rank rows, the host-sharing rows and the collective
probes, no multi-rank update) and raw/ (every launch's spec, raw timings and output).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shutil
import statistics
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Sequence

import torch
import torch.distributed as dist

from distlm.backends import get_backend
from distlm.backends.hardware import host_cores
from distlm.bench import plots, results
from distlm.bench.measure import KIB, MIB, LaunchSpec, measure_launch, rotated
from distlm.bench.worker import ERROR_PREFIX, PROGRESS_PREFIX
from distlm.choices import COMM_HOOKS, DEVICES, PP_SCHEDULES, STRATEGIES
from distlm.errors import OneLineErrorParser, UsageError, rank_from_environment, report_usage_error, whole_number_list
from distlm.launch.cluster_env import ClusterEnv
from distlm.launch.detect import detect_launch
from distlm.layout import Layout, PipelineLayout
from distlm.observe.run_record import run_json, write_run_json
from distlm.precision import DTYPES
from distlm.runtime.context import shutdown
from distlm.training.validation import validate


class LaunchFailed(RuntimeError):
    """A torchrun launch of the worker ended without a result."""


def _say(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def load_average() -> float | None:
    """This host's 1-minute load average; None where the OS keeps none."""
    try:
        return os.getloadavg()[0]
    except OSError:
        return None


def with_load(measure: Callable[[], dict[str, Any]], cores: int, label: str | None) -> dict[str, Any]:
    """``measure()``'s launch with the 1-minute load average read before and after it
    (``load_average``) and ``load_cores``, the cores the suite's ranks use on this host; with
    a ``label``, a line when the load exceeded them."""
    before = load_average()
    launch = measure()
    launch["load_average"], launch["load_cores"] = [before, load_average()], cores
    if label is not None and results.launch_under_load(launch):
        _say(f"[{label}] under load: the 1-minute load average was {before:.2f} before and "
             f"{launch['load_average'][1]:.2f} after, above the {cores} cores the suite's ranks use; this launch's "
             "times are noise")
    return launch


def name_list(flag: str, choices: Sequence[str]) -> Callable[[str], list[str]]:
    """An argparse ``type`` for ``flag``'s comma-separated names out of ``choices``."""

    def parse(text: str) -> list[str]:
        names = [part.strip() for part in text.split(",") if part.strip()]
        for name in names:
            if name not in choices:
                raise UsageError(f"{flag} {name} is unknown; choose from {', '.join(choices)} (comma-separated)")
        if not names:
            raise UsageError(f"{flag} needs at least one of " + ", ".join(choices))
        if len(set(names)) != len(names):
            raise UsageError(f"{flag} {text} names one twice")
        return names

    return parse


@dataclass(frozen=True)
class Launch:
    """What one launch measures: a world size, a comm hook, a tp and a pp degree, its strategies."""

    world_size: int
    comm_hook: str
    tp_degree: int
    strategies: tuple[str, ...]
    pp_degree: int = Layout.pp_degree

    @property
    def one_replica(self) -> bool:
        return self.world_size // (self.tp_degree * self.pp_degree) == 1

    def label(self) -> str:
        settings = "" if self.comm_hook == "allreduce" else f", --comm-hook {self.comm_hook}"
        settings += "" if self.tp_degree == 1 else f", tp {self.tp_degree}"
        settings += "" if self.pp_degree == 1 else f", pp {self.pp_degree}"
        return f"{self.world_size} rank{'s' if self.world_size > 1 else ''}{settings}"

    def stem(self) -> str:
        return (f"ranks{self.world_size}" + ("" if self.comm_hook == "allreduce" else f"_{self.comm_hook}")
                + ("" if self.tp_degree == 1 else f"_tp{self.tp_degree}")
                + ("" if self.pp_degree == 1 else f"_pp{self.pp_degree}"))

    def combination(self, strategy: str) -> list:
        """[strategy, comm hook, tp degree], and the pp degree where there is one."""
        return [strategy, self.comm_hook, self.tp_degree] + ([self.pp_degree] if self.pp_degree > 1 else [])


def build_parser() -> OneLineErrorParser:
    """The suite's flags; errors are one line (UsageError)."""
    parser = OneLineErrorParser(
        prog="python -m distlm.bench scaling", allow_abbrev=False,
        description="Throughput, step-time split, memory and efficiency of the Trainer over world sizes.",
    )
    add = parser.add_argument
    add("--arch", default="roberta_tiny", help="a distlm arch name (default roberta_tiny)")
    add("--ranks", type=whole_number_list("--ranks"), default=None,
        help="world sizes to measure, e.g. 1,2,4 (default 1,2); inside a launch: its own world size")
    add("--strategy", type=name_list("--strategy", STRATEGIES), default=[Layout.strategy],
        help=f"comma-separated, from {', '.join(STRATEGIES)} (default {Layout.strategy})")
    add("--mode", choices=("weak", "strong"), default="weak",
        help="weak: --batch-size per replica at every point; strong: one global batch split over the replicas")
    add("--steps", type=int, default=5, help="timed updates per point and repetition (default 5)")
    add("--warmup-steps", type=int, default=2, help="untimed updates first (default 2)")
    add("--repeats", type=int, default=3, help="repetitions of the whole list of points (default 3)")
    add("--batch-size", type=int, default=16, help="samples per micro-batch per data-parallel replica (default 16)")
    add("--global-batch-size", type=int, default=None,
        help="strong scaling: samples per update over all replicas (default: --batch-size x --update-freq x the "
             "replicas of the smallest world size)")
    add("--update-freq", type=int, default=1, help="micro-batches per update (default 1)")
    add("--tokens-per-sample", type=int, default=128, help="tokens per sample (default 128)")
    add("--precision", choices=tuple(DTYPES), default="fp32",
        help="fp32 (default), bf16 or fp16 (distlm.train's --bf16/--fp16)")
    add("--comm-hook", type=name_list("--comm-hook", COMM_HOOKS), default=[Layout.comm_hook],
        help=f"DDP's gradient all-reduce, comma-separated, from {', '.join(COMM_HOOKS)} (default {Layout.comm_hook}); "
             "measured with the strategies that take a hook (ddp, zero1)")
    add("--tp-degree", type=whole_number_list("--tp-degree"), default=[Layout.tp_degree],
        help=f"tensor-parallel degrees, comma-separated (default {Layout.tp_degree}); each at the world sizes "
             "it divides")
    add("--pp-degree", type=whole_number_list("--pp-degree"), default=[Layout.pp_degree],
        help=f"pipeline degrees, comma-separated (default {Layout.pp_degree}), passed to distlm.train's "
             "--pp-degree; each with every tp degree whose product with it divides the world size")
    add("--pp-schedule", choices=PP_SCHEDULES, default=PipelineLayout.schedule,
        help=f"as distlm.train's, for the points of --pp-degree above 1 (default {PipelineLayout.schedule})")
    add("--pp-microbatches", type=int, default=PipelineLayout.microbatches,
        help="as distlm.train's: micro-batches each replica's batch is split into "
             f"(default {PipelineLayout.microbatches}: twice the pp degree)")
    add("--pp-stages-per-rank", type=int, default=PipelineLayout.stages_per_rank,
        help="as distlm.train's: stages on each rank, 2 or more for the looped schedules "
             f"(default {PipelineLayout.stages_per_rank})")
    add("--bucket-cap-mb", type=float, default=Layout.bucket_cap_mb,
        help=f"DDP gradient bucket size in MiB (default {Layout.bucket_cap_mb:g})")
    add("--data", default=None,
        help="as distlm.train's --data: a fairseq-preprocess directory (default: the built-in corpus)")
    add("--device", choices=DEVICES, default="auto", help="as distlm.train's --device (default auto)")
    add("--threads-per-rank", type=int, default=None,
        help="OMP_NUM_THREADS of every rank (default: this machine's cores over the largest world size, at least 1)")
    add("--allreduce-max-mib", type=float, default=16.0,
        help="largest buffer of the collective probe (all-reduce, all-gather, reduce-scatter), 64 KiB x 4^k "
             "up to this (default 16; 0: no probe)")
    add("--no-host-sharing", dest="host_sharing", action="store_false",
        help="on one machine, do not also time N one-rank launches at once for each world size N > 1 "
             "(what sharing the host costs compute, for distlm.plan --calibrate)")
    add("--no-plots", action="store_true", help="write no PNG files (matplotlib not needed)")
    add("--out", required=True, help="output directory")
    return parser


def parse_args(argv: Sequence[str]) -> argparse.Namespace:
    """The command line, with every value checked on its own (UsageError: one line)."""
    args = build_parser().parse_args(list(argv))
    for flag, minimum in (("steps", 1), ("warmup_steps", 1), ("repeats", 1), ("batch_size", 1),
                          ("update_freq", 1), ("tokens_per_sample", 1)):
        value = getattr(args, flag)
        if value < minimum:
            raise UsageError(f"--{flag.replace('_', '-')} must be at least {minimum}, got {value}")
    for flag, degrees in (("--tp-degree", args.tp_degree), ("--pp-degree", args.pp_degree)):
        for degree in degrees:
            if degree < 1:
                raise UsageError(f"{flag} must be at least 1, got {degree}")
        if len(set(degrees)) != len(degrees):
            raise UsageError(f"{flag} {','.join(map(str, degrees))} names a degree twice")
    if args.pp_microbatches < 0:
        raise UsageError(f"--pp-microbatches must be 0 (twice the pp degree) or more, got {args.pp_microbatches}")
    if args.pp_stages_per_rank < 1:
        raise UsageError(f"--pp-stages-per-rank must be at least 1, got {args.pp_stages_per_rank}")
    if pipeline_layout(args) != PipelineLayout() and max(args.pp_degree) == 1:
        raise UsageError("--pp-schedule, --pp-microbatches and --pp-stages-per-rank set the pipeline points; "
                         "add --pp-degree with a degree above 1")
    if args.threads_per_rank is not None and args.threads_per_rank < 1:
        raise UsageError(f"--threads-per-rank must be at least 1, got {args.threads_per_rank}")
    if args.allreduce_max_mib < 0:
        raise UsageError(f"--allreduce-max-mib must be 0 (no probe) or positive, got {args.allreduce_max_mib:g}")
    if args.global_batch_size is not None:
        if args.mode != "strong":
            raise UsageError("--global-batch-size fixes the global batch of strong scaling; add --mode strong")
        if args.global_batch_size < 1:
            raise UsageError(f"--global-batch-size must be at least 1, got {args.global_batch_size}")
    if args.ranks is not None:
        check_ranks(args.ranks, args.tp_degree, args.pp_degree)
    if not args.no_plots:
        plots.require_matplotlib()
    return args


def check_ranks(ranks: list[int], tp_degrees: list[int], pp_degrees: list[int] = (1,)) -> None:
    """UsageError for a world size below 1, a multiple of none of the tp (x pp) degrees, or given twice."""
    for count in ranks:
        if count < 1:
            raise UsageError(f"--ranks must be at least 1, got {count}")
        if all(count % (tp * pp) for tp in tp_degrees for pp in pp_degrees):
            raise UsageError(
                f"--ranks {count} is not a multiple of --tp-degree {','.join(map(str, tp_degrees))}"
                + ("" if list(pp_degrees) == [1] else f" x --pp-degree {','.join(map(str, pp_degrees))}")
            )
    if len(set(ranks)) != len(ranks):
        raise UsageError(f"--ranks {','.join(map(str, ranks))} names a world size twice")


def global_batch_size(args: argparse.Namespace, ranks: list[int]) -> int:
    """Strong scaling's samples per update: given, or the fewest replicas of any point at --batch-size."""
    if args.global_batch_size is not None:
        return args.global_batch_size
    replicas = min(count // (tp * pp) for count in ranks for tp in args.tp_degree for pp in args.pp_degree
                   if count % (tp * pp) == 0)
    return args.batch_size * args.update_freq * replicas


def replica_batch_size(
    args: argparse.Namespace, world_size: int, ranks: list[int], tp_degree: int = Layout.tp_degree,
    pp_degree: int = Layout.pp_degree,
) -> int:
    """Samples per micro-batch per replica at ``world_size`` with ``tp_degree`` and ``pp_degree``."""
    if args.mode == "weak":
        return args.batch_size
    total = global_batch_size(args, ranks)
    dp = world_size // (tp_degree * pp_degree)
    per_replica, rest = divmod(total, dp * args.update_freq)
    if rest or per_replica == 0:
        raise UsageError(
            f"--mode strong: the global batch of {total} samples does not split into whole micro-batches "
            f"(--update-freq {args.update_freq}) over the {dp} replicas of {world_size} ranks; "
            f"set --global-batch-size to a multiple of {dp * args.update_freq}"
        )
    return per_replica


def allreduce_sizes(max_mib: float) -> list[int]:
    """Probe sizes in bytes: 64 KiB x 4^k up to ``max_mib`` MiB (none for 0)."""
    sizes, size = [], 64 * KIB
    while size <= max_mib * MIB:
        sizes.append(size)
        size *= 4
    return sizes


def launch_spec(
    args: argparse.Namespace, launch: Launch, strategies: list[str], ranks: list[int], probe: bool = True
) -> LaunchSpec:
    """What ``launch`` measures (``strategies`` in this order), out of the sweep over ``ranks``;
    with ``probe`` and more than one rank, the collective probe too."""
    world_size = launch.world_size
    layout = Layout(tp_degree=launch.tp_degree, pp_degree=launch.pp_degree, bucket_cap_mb=args.bucket_cap_mb,
                    comm_hook=launch.comm_hook, pipeline=pipeline_layout(args))
    return LaunchSpec(
        arch=args.arch, strategies=strategies,
        batch_size=replica_batch_size(args, world_size, ranks, launch.tp_degree, launch.pp_degree),
        update_freq=args.update_freq, tokens_per_sample=args.tokens_per_sample, precision=args.precision,
        device=args.device, steps=args.steps, warmup_steps=args.warmup_steps, layout=layout, data=args.data,
        allreduce_sizes=allreduce_sizes(args.allreduce_max_mib) if world_size > 1 and probe else [],
    )


def pipeline_layout(args: argparse.Namespace) -> PipelineLayout:
    """The pipeline of the points of --pp-degree above 1, from the suite's flags."""
    return PipelineLayout(schedule=args.pp_schedule, microbatches=args.pp_microbatches,
                          stages_per_rank=args.pp_stages_per_rank)


def plan_launches(args: argparse.Namespace, ranks: list[int], env: ClusterEnv | None = None) -> list[Launch]:
    """The launches of the sweep, each point checked by distlm.train's own validation first.

    Per world size, every tp degree dividing it and every comm hook, with the strategies
    distlm.train runs them with (comm hooks are DDP's: ddp and zero1 without tensor
    parallel). With one data-parallel replica nothing communicates and nothing is wrapped
    or sharded, so one launch of one strategy stands for every strategy and hook of that
    tp degree. A combination distlm.train refuses is left out (and said so) when the
    requested values have points elsewhere; a requested value with no point at all is a
    UsageError with distlm.train's reason.
    """
    backend = get_backend(args.device)
    launches, refused, used = [], {}, set()
    for world_size in ranks:
        layout = env or ClusterEnv(
            rank=0, world_size=world_size, local_rank=0, local_world_size=world_size, node_rank=0, num_nodes=1,
            master_addr="127.0.0.1", master_port=29500, launcher="torchelastic",
        )
        for tp_degree, pp_degree in ((tp, pp) for tp in args.tp_degree for pp in args.pp_degree):
            if world_size % (tp_degree * pp_degree):
                continue
            for comm_hook in args.comm_hook:
                candidate = Launch(world_size, comm_hook, tp_degree, (), pp_degree)
                runs = []
                for strategy in args.strategy:
                    spec = launch_spec(args, candidate, [strategy], ranks)
                    try:
                        validate(spec.trainer_config(strategy), layout, backend)
                    except UsageError as exc:
                        refused.setdefault((strategy, comm_hook, tp_degree, pp_degree), exc)
                        continue
                    runs.append(strategy)
                    used |= {("--strategy", strategy), ("--comm-hook", comm_hook), ("--tp-degree", tp_degree),
                             ("--pp-degree", pp_degree)}
                if runs:
                    launches.append(Launch(world_size, comm_hook, tp_degree, tuple(runs), pp_degree))
    requested = ([("--strategy", name) for name in args.strategy] + [("--comm-hook", name) for name in args.comm_hook]
                 + [("--tp-degree", degree) for degree in args.tp_degree]
                 + [("--pp-degree", degree) for degree in args.pp_degree])
    for flag, value in requested:
        if (flag, value) not in used:
            reasons = [exc for key, exc in refused.items() if value in key]
            if reasons:
                raise reasons[0]
            raise UsageError(f"{flag} {value} has no point in --ranks {','.join(map(str, ranks))}")
    for (strategy, comm_hook, tp_degree, pp_degree), exc in refused.items():
        _say(f"distlm.bench scaling: leaving out {strategy} with --comm-hook {comm_hook}, --tp-degree "
             f"{tp_degree} and --pp-degree {pp_degree}: {exc}")
    return launches


def measured_launches(launches: list[Launch]) -> list[Launch]:
    """The launches to run: with one data-parallel replica, one strategy of the first hook
    for each tp and pp degree (it stands for the others)."""
    kept, seen = [], set()
    for launch in launches:
        if launch.one_replica:
            if (launch.world_size, launch.tp_degree, launch.pp_degree) in seen:
                continue
            seen.add((launch.world_size, launch.tp_degree, launch.pp_degree))
            launch = dataclasses.replace(launch, strategies=launch.strategies[:1])
        kept.append(launch)
    return kept


def combinations(launches: list[Launch]) -> list[list]:
    """Every [strategy, comm hook, tp degree (, pp degree)] distlm.train runs at some world size of the sweep."""
    found: list[list] = []
    for launch in launches:
        for strategy in launch.strategies:
            if launch.combination(strategy) not in found:
                found.append(launch.combination(strategy))
    return found


# ---------------------------------------------------------------------------- running


def run_launches(
    args: argparse.Namespace, ranks: list[int], planned: list[Launch], out_dir: Path
) -> list[dict[str, Any]]:
    """Every launch once per repetition, world sizes in rotated order, each in its own torchrun."""
    threads = args.threads_per_rank or max(1, host_cores() // max(ranks))
    cores = threads * max(ranks)  # what the largest launch, and so the suite, runs on
    raw = out_dir / "raw"
    raw.mkdir(parents=True, exist_ok=True)
    launches = []
    _say(f"distlm.bench scaling: {args.arch}, {args.mode} scaling, ranks {','.join(map(str, ranks))}, "
         f"strategies {','.join(args.strategy)}, comm hooks {','.join(args.comm_hook)}, tp degrees "
         f"{','.join(map(str, args.tp_degree))}, pp degrees {','.join(map(str, args.pp_degree))}, "
         f"{args.repeats} repetition(s), {threads} thread(s) per rank")
    for repeat in range(args.repeats):
        for world_size in rotated(ranks, repeat):
            # The collective probe times the world size's process group, whatever a launch's
            # tp and pp degrees: the first launch of the world size runs it for every repetition.
            for index, planned_launch in enumerate(
                    rotated([item for item in planned if item.world_size == world_size], repeat)):
                strategies = rotated(list(planned_launch.strategies), repeat)
                spec = launch_spec(args, planned_launch, strategies, ranks, probe=index == 0)
                label = f"repetition {repeat + 1}/{args.repeats}, {planned_launch.label()}"
                _say(f"[{label}] {', '.join(strategies)}: batch {spec.batch_size} x {spec.update_freq} per replica")
                started = time.perf_counter()
                stem = raw / f"rep{repeat + 1}_{planned_launch.stem()}"
                launch = with_load(lambda: run_torchrun(spec, world_size, threads, stem, label), cores, label)
                launches.append(launch)
                _report(launch, label, started)
            if world_size > 1 and args.host_sharing and any(item.tp_degree == item.pp_degree == 1 for item in planned):
                spec = host_sharing_spec(args, world_size, ranks, planned)
                label = f"repetition {repeat + 1}/{args.repeats}, {world_size} one-rank launches at once"
                _say(f"[{label}] {spec.strategies[0]}: batch {spec.batch_size} x {spec.update_freq} each")
                started = time.perf_counter()
                launch = with_load(lambda: run_concurrent(
                    spec, world_size, threads, raw / f"rep{repeat + 1}_alone{world_size}", label), cores, label)
                launches.append(launch)
                _say(f"[{label}] compute {launch['compute_s']:.4f} s (slowest of {world_size}: "
                     f"{launch['slowest_compute_s']:.4f} s), optimizer {launch['optimizer_s']:.4f} s "
                     f"({time.perf_counter() - started:.0f} s)")
    return launches


def host_sharing_spec(
    args: argparse.Namespace, world_size: int, ranks: list[int], planned: list[Launch]
) -> LaunchSpec:
    """A one-rank launch with ``world_size``'s batch per replica, to run ``world_size`` times at once."""
    first = next(launch for launch in planned if launch.tp_degree == launch.pp_degree == 1)
    spec = launch_spec(args, Launch(1, first.comm_hook, 1, first.strategies[:1]), list(first.strategies[:1]), ranks)
    return dataclasses.replace(spec, batch_size=replica_batch_size(args, world_size, ranks), allreduce_sizes=[],
                               concurrent_processes=world_size)


def run_concurrent(spec: LaunchSpec, processes: int, threads: int, stem: Path, label: str) -> dict[str, Any]:
    """``processes`` one-rank workers at once, each a plain ``python -m distlm.bench.worker``
    timing while all the others do (``measure.HostSharing``). Returns the launches' mean
    compute and optimizer seconds (each launch's median over its updates) and the expected
    slowest compute of ``processes`` updates drawn from all of theirs: a synchronised update
    of that many ranks waits for its slowest."""
    meeting = stem.with_name(stem.name + ".rendezvous")
    shutil.rmtree(meeting, ignore_errors=True)
    meeting.mkdir(parents=True)
    spec = dataclasses.replace(spec, rendezvous_dir=str(meeting))
    workers = [
        _start_worker([sys.executable, "-m", "distlm.bench.worker"], spec, threads,
                      stem.with_name(f"{stem.name}_{index}"), label if index == 0 else None)
        for index in range(processes)
    ]
    try:
        outputs = [_finish_worker(worker, f"one of {processes} concurrent one-rank launches") for worker in workers]
    except BaseException:
        for worker in workers:  # the others would wait for the failed one at the rendezvous
            worker.process.terminate()
        raise
    summaries = [results.launch_summary(output["strategies"][0]) for output in outputs]
    computes = [step - optimizer for output in outputs
                for step, optimizer in zip(output["strategies"][0]["step_s"], output["strategies"][0]["optimizer_s"])]
    return {
        "spec": spec.to_json(), "concurrent_processes": processes, "threads_per_rank": threads,
        "device": outputs[0]["device"], "vocab_size": outputs[0]["strategies"][0]["vocab_size"],
        "compute_s": statistics.fmean(s["step"] - s["optimizer"] for s in summaries),
        "slowest_compute_s": results.expected_slowest(computes, processes),
        "optimizer_s": statistics.fmean(s["optimizer"] for s in summaries),
    }


def _report(launch: dict[str, Any], label: str, started: float) -> None:
    for times in launch["strategies"]:
        summary = results.launch_summary(times)
        compute = "" if summary["compute"] is None else f", compute {summary['compute']:.4f} s"
        _say(f"[{label}] {times['strategy']}: update {summary['step']:.4f} s{compute}, "
             f"optimizer {summary['optimizer']:.4f} s ({time.perf_counter() - started:.0f} s for the launch)")


def run_torchrun(spec: LaunchSpec, world_size: int, threads: int, stem: Path, label: str) -> dict[str, Any]:
    """One torchrun of the worker; its output goes to ``stem``.log, progress lines also to stderr."""
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(world_size), "--standalone",
               "-m", "distlm.bench.worker"]
    return _finish_worker(_start_worker(command, spec, threads, stem, label), f"the {world_size}-rank launch")


@dataclass
class _Worker:
    """A started worker launch, its output being copied by ``reader``."""

    process: subprocess.Popen
    reader: threading.Thread
    out_path: Path
    log_path: Path
    errors: list[str]


def _start_worker(command: list[str], spec: LaunchSpec, threads: int, stem: Path, label: str | None) -> _Worker:
    """Start ``command SPEC.json OUT.json`` with ``threads`` per rank; a thread copies its
    output to ``stem``.log and, with a ``label``, its progress lines to stderr."""
    spec_path, out_path, log_path = (stem.with_name(stem.name + suffix) for suffix in (".spec.json", ".json", ".log"))
    spec_path.write_text(json.dumps(spec.to_json(), indent=1))
    out_path.unlink(missing_ok=True)
    package_root = str(Path(__file__).resolve().parents[2])
    python_path = os.pathsep.join(filter(None, [package_root, os.environ.get("PYTHONPATH")]))
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), "PYTHONPATH": python_path}
    process = subprocess.Popen([*command, str(spec_path), str(out_path)], stdout=subprocess.PIPE,
                               stderr=subprocess.STDOUT, text=True, env=env)
    errors: list[str] = []

    def copy_output() -> None:
        with open(log_path, "w") as log:
            for line in process.stdout:
                log.write(line)
                if line.startswith(PROGRESS_PREFIX) and label is not None:
                    _say(f"[{label}] {line[len(PROGRESS_PREFIX):].rstrip()}")
                elif ERROR_PREFIX in line:
                    errors.append(line.split(ERROR_PREFIX, 1)[1].strip())

    reader = threading.Thread(target=copy_output, daemon=True)
    reader.start()
    return _Worker(process, reader, out_path, log_path, errors)


def _finish_worker(worker: _Worker, what: str) -> dict[str, Any]:
    """The worker's result once it has ended; UsageError with its first error line, LaunchFailed without one."""
    try:
        status = worker.process.wait()
    except BaseException:
        worker.process.terminate()  # torchrun stops its workers
        raise
    worker.reader.join()
    if worker.errors:
        raise UsageError(worker.errors[0])
    if status != 0 or not worker.out_path.is_file():
        raise LaunchFailed(f"{what} failed (exit status {status}); its output is in {worker.log_path}")
    return json.loads(worker.out_path.read_text())


def run_in_place(args: argparse.Namespace, env: ClusterEnv, planned: list[Launch]) -> list[dict[str, Any]]:
    """This launch's world size, every repetition in this process; complete on rank 0."""
    ranks = [env.world_size]
    launches = []
    for repeat in range(args.repeats):
        for index, planned_launch in enumerate(rotated(planned, repeat)):
            strategies = rotated(list(planned_launch.strategies), repeat)
            spec = launch_spec(args, planned_launch, strategies, ranks, probe=index == 0)
            label = f"repetition {repeat + 1}/{args.repeats}, {planned_launch.label()} in place"

            def progress(line: str, label: str = label) -> None:
                if env.rank == 0:
                    _say(f"[{label}] {line}")

            # The launch's ranks on this host; each rank reads its own host's load, rank 0's is kept.
            cores = env.local_world_size * torch.get_num_threads()
            launches.append(with_load(lambda: {"spec": spec.to_json(), **measure_launch(spec, progress)}, cores,
                                      label if env.rank == 0 else None))
    return launches


def write_outputs(
    args: argparse.Namespace, launches: list[dict[str, Any]], combos: list[list], out_dir: Path, merge: bool
) -> list[dict]:
    """results.jsonl, allreduce.jsonl, calibration.jsonl, results.md and the plots."""
    settings = {"arch": args.arch, "mode": args.mode, "strategies": args.strategy, "combinations": combos}
    sharing = results.host_sharing_rows([launch for launch in launches if "concurrent_processes" in launch])
    launches = [launch for launch in launches if "concurrent_processes" not in launch]
    rows = results.point_rows(launches, settings)
    reports = results.allreduce_reports(launches)
    if merge:
        rows = results.merge_rows(results.read_jsonl(out_dir / results.RESULTS), rows)
        reports = results.merge_reports(results.read_jsonl(out_dir / results.ALLREDUCE), reports)
    if reports:
        results.write_jsonl(out_dir / results.ALLREDUCE, reports)
    calibration = results.calibration_objects(rows, reports, sharing)
    if calibration:
        results.write_jsonl(out_dir / results.CALIBRATION, calibration)
        if not merge:
            # The planner's local profile is this machine, where the suite ran every point;
            # inside a launch the ranks may span a cluster it does not describe.
            for line in results.predict_step_times(rows, out_dir / results.CALIBRATION, args.bucket_cap_mb):
                _say(f"distlm.bench scaling: {line}")
    results.write_jsonl(out_dir / results.RESULTS, rows)
    (out_dir / results.TABLE).write_text(results.markdown_table(rows))
    if not args.no_plots:
        plots.write_plots(rows, out_dir)
    return rows


def main(argv: Sequence[str]) -> int:
    """``python -m distlm.bench scaling ARGV``; returns the exit status (2: bad input)."""
    rank = rank_from_environment()
    try:
        args = parse_args(argv)
        env = detect_launch()
        rank = env.rank
        out_dir = Path(args.out)
        in_place = env.launcher != "single"
        if in_place:
            if args.ranks is not None and args.ranks != [env.world_size]:
                raise UsageError(
                    f"inside a launch of {env.world_size} ranks the suite measures that world size; "
                    f"drop --ranks or give --ranks {env.world_size}"
                )
            check_ranks([env.world_size], args.tp_degree, args.pp_degree)
            if args.mode == "strong" and args.global_batch_size is None:
                raise UsageError(
                    "--mode strong inside a launch needs --global-batch-size, the same in every launch of the sweep"
                )
            planned = plan_launches(args, [env.world_size], env)
            launches = run_in_place(args, env, measured_launches(planned))
        else:
            ranks = sorted(args.ranks or [1, 2])
            check_ranks(ranks, args.tp_degree, args.pp_degree)
            planned = plan_launches(args, ranks)
            out_dir.mkdir(parents=True, exist_ok=True)
            launches = run_launches(args, ranks, measured_launches(planned), out_dir)
        if rank == 0:
            out_dir.mkdir(parents=True, exist_ok=True)
            rows = write_outputs(args, launches, combinations(planned), out_dir, merge=in_place)
            write_run_json(out_dir, run_json(vars(args), {"launcher": env.launcher, "world_size": env.world_size,
                                                          "ranks": sorted({launch.world_size for launch in planned})}))
            _say(results.markdown_table(rows))
            _say(f"wrote {out_dir / results.RESULTS} ({len(rows)} points), {results.TABLE}"
                 + ("" if args.no_plots else ", " + ", ".join(plots.PLOTS)))
        if in_place and env.is_distributed:
            dist.barrier()  # rank 0 has written everything before any rank leaves
    except UsageError as exc:
        return report_usage_error(ERROR_PREFIX, exc, rank)
    except LaunchFailed as exc:
        _say(f"{ERROR_PREFIX}{exc}")
        return 1
    finally:
        shutdown()
    return 0
