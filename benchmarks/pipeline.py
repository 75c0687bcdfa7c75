"""Step time of each pipeline schedule against the planner's prediction, and its measured bubble against (P-1)/(M+P-1).

    torchrun --nproc_per_node 2 benchmarks/pipeline.py [--arch llama_tiny --rounds 6 --steps 3]

Every schedule is a full distlm Trainer at --pp-degree = the world size, trained on the
same batch; rounds alternate between them (the order rotates every round) because this
machine is noisy, and the report gives medians. The idle fraction of a schedule is
1 - (T1 / P) / T, where T1 is the step time of the whole model in one process (rank 0
alone, the other ranks waiting) on the same batch, run as the same M micro-batches with
their gradients accumulated, and T the pipeline's: perfectly balanced stages with free
transfers would make it the schedule's bubble, (P-1)/(M+P-1) for GPipe and 1F1B, divided
by the stages per rank V for the looped schedules; the rest is point-to-point transfers,
imbalance, the schedule's own work, and ranks sharing the host's cores.

The prediction is distlm.plan's projection of the same workload (model, batch, M, V, P) on
this machine: its ``local`` profile (every rank on this host's cores), calibrated as the
scaling suite's one-rank rows calibrate it, from one process's update of the whole model
timed in the same rounds (T1): its forward and backward give the achieved FLOP/s, its
clipping and optimizer step the memory bandwidth. As it runs the pipeline's micro-batches,
the calibration holds for the matrix sizes the stages compute with. The point-to-point link
stays the profile's: the planner has no probe of it. Prints one JSON object (rank 0) on
stdout and the table on stderr; bad input is one line and exit status 2.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist

from distlm.backends.hardware import host_cores
from distlm.config import parse_args
from distlm.data.batches import to_device
from distlm.errors import (
    OneLineErrorParser,
    UsageError,
    exit_without_teardown,
    rank_from_environment,
    report_usage_error,
)
from distlm.models.loss import summed_cross_entropy
from distlm.models.flops import model_shape
from distlm.plan.calibrate import Calibration, optimizer_bandwidth, update_flops
from distlm.layout import Layout, PipelineLayout
from distlm.plan.model import Placement, Workload, load_cluster, project
from distlm.training.trainer import Trainer

SCHEDULES = {
    "gpipe": ["--pp-schedule", "gpipe"],
    "1f1b": ["--pp-schedule", "1f1b"],
    "interleaved-1f1b": ["--pp-schedule", "interleaved-1f1b", "--pp-stages-per-rank", "2"],
    "zero-bubble": ["--pp-schedule", "zero-bubble", "--pp-stages-per-rank", "2"],
    "zbv": ["--pp-schedule", "zbv", "--pp-stages-per-rank", "2"],
}
# A prediction further than this from the measured step is flagged in the report.
FAR_OFF = 0.25


def timed(step, batches, steps: int) -> float:
    start = time.perf_counter()
    for i in range(steps):
        step(batches[i % len(batches)])
    return (time.perf_counter() - start) / steps


def split_batch(batch: dict, count: int) -> list[dict]:
    """``batch`` cut into ``count`` micro-batches along its samples, as the pipeline cuts it."""
    samples = batch["targets"].shape[0]
    chunks = [dict() for _ in range(count)]
    for key, value in batch.items():
        split = isinstance(value, torch.Tensor) and value.dim() > 0 and value.shape[0] == samples
        for chunk, part in zip(chunks, value.tensor_split(count) if split else [value] * count):
            chunk[key] = part
    return chunks


class OneProcess:
    """An update of the whole single-device model (forward and backward of each of
    ``microbatches`` micro-batches, clipping, AdamW), the work the pipeline's stages share
    out; it records the seconds of clipping and the optimizer step of each update."""

    def __init__(self, trainer: Trainer, microbatches: int):
        spec = trainer.spec
        self.model = spec.build(len(trainer.data.dictionary), trainer.pad_id)
        self.model.to_empty(device="cpu")
        self.model.init_weights()
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=1e-4)
        self.clip_norm = trainer.config.optim.clip_norm
        self.inputs = trainer.model_inputs
        self.microbatches = microbatches
        self.optimizer_s: list[float] = []

    def __call__(self, batches) -> None:
        for batch in batches:
            for part in split_batch(to_device(batch, torch.device("cpu")), self.microbatches):
                summed_cross_entropy(self.model, part, self.inputs).backward()
        start = time.perf_counter()
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.clip_norm)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.optimizer_s.append(time.perf_counter() - start)


def planner_predictions(shape, args, world_size: int, compute_s: float, optimizer_s: float) -> tuple[dict, list[str]]:
    """Per schedule, the planner's projection of this benchmark's update at pp = ``world_size``,
    the local profile calibrated from one process's update (``compute_s``: forward and
    backward of the batch; ``optimizer_s``: clipping and AdamW); and what it was told."""
    achieved = update_flops(shape, args.tokens_per_sample, args.batch_size) / compute_s
    calibration = Calibration(
        achieved_flops={"fp32": achieved}, memory_bandwidth_Bps=optimizer_bandwidth(shape, optimizer_s),
        threads_per_rank=torch.get_num_threads(), host_cores=host_cores(),
    )
    cluster = calibration.apply(load_cluster("local", ranks_per_node=world_size))
    projections = {}
    for name, flags in SCHEDULES.items():
        stages_per_rank = (int(flags[flags.index("--pp-stages-per-rank") + 1]) if "--pp-stages-per-rank" in flags
                           else PipelineLayout.stages_per_rank)
        layout = Layout(pp_degree=world_size, pipeline=PipelineLayout(
            schedule=name, microbatches=args.microbatches, stages_per_rank=stages_per_rank))
        workload = Workload(shape=shape, layout=layout, tokens_per_sample=args.tokens_per_sample,
                            batch_size=args.batch_size)
        projections[name] = project(workload, cluster, Placement(nodes=1, ranks_per_node=world_size, layout=layout))
    notes = [
        f"calibrated from one process's update: {achieved / 1e9:.1f} GFLOP/s achieved, optimizer step at "
        f"{cluster.memory_bandwidth_Bps / 1e9:.2f} GB/s",
        f"{cluster.cpu_threads_per_rank} thread(s) per rank on {cluster.cores_per_node} cores: compute slowed "
        f"{projections['1f1b'].compute_slowdown:.2f}x by {world_size} ranks sharing them",
        f"point-to-point link: the local profile's {cluster.intra.latency_s * 1e6:.0f} us + bytes at "
        f"{cluster.intra.bandwidth_Bps / 1e9:.1f} GB/s, not measured",
    ]
    return projections, notes


def main() -> int:
    try:
        run(parse_command_line())
    except UsageError as exc:
        return report_usage_error("benchmarks/pipeline.py: error: ", exc, rank_from_environment())
    return 0


def parse_command_line() -> argparse.Namespace:
    parser = OneLineErrorParser(prog="benchmarks/pipeline.py", description=__doc__.splitlines()[0])
    parser.add_argument("--arch", default="llama_tiny")
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--microbatches", type=int, default=8)
    parser.add_argument("--tokens-per-sample", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--steps", type=int, default=3, help="updates per timed round")
    args = parser.parse_args()
    for name in ("layers", "batch_size", "microbatches", "tokens_per_sample", "rounds", "steps"):
        if getattr(args, name) < 1:
            raise UsageError(f"--{name.replace('_', '-')} must be at least 1, got {getattr(args, name)}")
    if int(os.environ.get("WORLD_SIZE", "1")) < 2:
        raise UsageError("run it under torchrun --nproc_per_node P, P >= 2: the pipeline degree")
    return args


def run(args: argparse.Namespace) -> None:
    world_size = int(os.environ["WORLD_SIZE"])
    base = ["--arch", args.arch, "--decoder-layers" if "llama" in args.arch else "--encoder-layers", str(args.layers),
            "--tokens-per-sample", str(args.tokens_per_sample), "--batch-size", str(args.batch_size),
            "--dropout", "0", "--attention-dropout", "0", "--no-save", "--device", "cpu",
            "--max-update", "1000000", "--log-interval", "1000000"]
    pp = ["--pp-degree", str(world_size), "--pp-microbatches", str(args.microbatches)]
    trainers, batches = {}, {}
    for name, flags in SCHEDULES.items():
        trainers[name] = Trainer(parse_args(base + pp + flags))
        loader = trainers[name].update_batches()
        batches[name] = [next(loader) for _ in range(args.steps)]
        timed(trainers[name].train_step, batches[name], 1)  # warm-up: shapes, first allocations

    single = None
    if dist.get_rank() == 0:
        single = OneProcess(trainers["1f1b"], args.microbatches)
        timed(single, batches["1f1b"], 1)

    times = {name: [] for name in [*trainers, "one_process"]}
    names = list(trainers)
    for round_index in range(args.rounds):
        shift = round_index % len(names)
        for name in names[shift:] + names[:shift]:
            dist.barrier()
            times[name].append(timed(trainers[name].train_step, batches[name], args.steps))
        dist.barrier()
        if single is not None:
            single.optimizer_s.clear()
            times["one_process"].append(timed(single, batches["1f1b"], args.steps))
            times.setdefault("one_process_optimizer", []).append(statistics.fmean(single.optimizer_s))
        dist.barrier()

    if dist.get_rank() == 0:
        whole = statistics.median(times["one_process"])
        optimizer = statistics.median(times["one_process_optimizer"])
        projections, notes = planner_predictions(model_shape(single.model), args, world_size, whole - optimizer,
                                                 optimizer)
        rows = {}
        for name, flags in SCHEDULES.items():
            step = statistics.median(times[name])
            per_rank = 2 if "--pp-stages-per-rank" in flags else 1
            stages, count = world_size, args.microbatches
            projection = projections[name]
            off = projection.step_time_s / step - 1
            rows[name] = {
                "step_s_median": round(step, 4),
                "step_s_rounds": [round(t, 4) for t in times[name]],
                "predicted_step_s": round(projection.step_time_s, 4),
                "predicted_vs_measured": round(off, 3),
                "predicted_bubble_s": round(projection.pp_bubble_s, 4),
                "predicted_p2p_s": round(projection.pp_p2p_s, 4),
                "speedup_vs_one_process": round(whole / step, 3),
                "idle_fraction_measured": round(1 - whole / world_size / step, 3),
                "bubble_theory": round((stages - 1) / (count + stages - 1) / per_rank, 3),
            }
            if abs(off) > FAR_OFF:
                rows[name]["prediction_note"] = (
                    f"far off: the planner is {abs(off):.0%} {'high' if off > 0 else 'low'}; it models only the "
                    "calibrated compute, the bubble, the transfers on the profile's link and the optimizer step")
        report = {
            "benchmark": "pipeline", "world_size": world_size, "arch": args.arch, "layers": args.layers,
            "batch_size": args.batch_size, "microbatches": args.microbatches,
            "tokens_per_sample": args.tokens_per_sample, "rounds": args.rounds, "steps_per_round": args.steps,
            "threads_per_rank": torch.get_num_threads(), "host_cores": host_cores(), "load_average": os.getloadavg(),
            "one_process_step_s_median": round(whole, 4), "one_process_optimizer_s_median": round(optimizer, 4),
            "planner": notes, "schedules": rows,
        }
        print(json.dumps(report, indent=2), flush=True)
        print(format_table(report), file=sys.stderr, flush=True)
    dist.barrier()
    dist.destroy_process_group()


def format_table(report: dict) -> str:
    """The report as the Markdown table the README shows."""
    lines = [
        f"| schedule | step (s) | predicted (s) | predicted vs measured | vs one process "
        f"({report['one_process_step_s_median']:.2f} s) | idle measured | bubble formula |",
        "|---|---|---|---|---|---|---|",
    ]
    for name, row in report["schedules"].items():
        label = name if name in ("gpipe", "1f1b") else f"{name} (V 2)"
        lines.append(
            f"| {label} | {row['step_s_median']:.3f} | {row['predicted_step_s']:.3f} "
            f"| {row['predicted_vs_measured']:+.0%} | {row['speedup_vs_one_process']:.2f}x "
            f"| {row['idle_fraction_measured']:.2f} | {row['bubble_theory']:.2f} |"
        )
    return "\n".join(lines + [f"planner: {note}" for note in report["planner"]])


if __name__ == "__main__":
    exit_without_teardown(main())  # gloo threads may outlive main(); see its docstring
