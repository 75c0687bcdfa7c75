"""Step time of each pipeline schedule, and its measured bubble against (P-1)/(M+P-1).

    torchrun --nproc_per_node 2 benchmarks/pipeline.py [--arch llama_tiny --rounds 6 --steps 3]

Every schedule is a full distlm Trainer at --pp-degree = the world size, trained on the
same batch; rounds alternate between them (the order rotates every round) because this
machine is noisy, and the report gives medians. The idle fraction of a schedule is
1 - (T1 / P) / T, where T1 is the step time of the whole model in one process (rank 0
alone, the other ranks waiting) on the same batch and T the pipeline's: perfectly
balanced stages with free transfers would make it the schedule's bubble, (P-1)/(M+P-1)
for GPipe and 1F1B, divided by the stages per rank V for the looped schedules; the
rest is point-to-point transfers and imbalance. Prints one JSON object (rank 0).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import torch
import torch.distributed as dist

from distlm.config import parse_args
from distlm.data.batches import to_device
from distlm.loss import summed_cross_entropy
from distlm.trainer import Trainer
from distlm.train import exit_without_teardown

SCHEDULES = {
    "gpipe": ["--pp-schedule", "gpipe"],
    "1f1b": ["--pp-schedule", "1f1b"],
    "interleaved-1f1b": ["--pp-schedule", "interleaved-1f1b", "--pp-stages-per-rank", "2"],
    "zero-bubble": ["--pp-schedule", "zero-bubble", "--pp-stages-per-rank", "2"],
    "zbv": ["--pp-schedule", "zbv", "--pp-stages-per-rank", "2"],
}


def timed(step, batches, steps: int) -> float:
    start = time.perf_counter()
    for i in range(steps):
        step(batches[i % len(batches)])
    return (time.perf_counter() - start) / steps


def one_process_step(trainer: Trainer):
    """An update of the whole single-device model on a batch (forward, backward, AdamW),
    the work the pipeline's stages share out."""
    spec = trainer.spec
    model = spec.build(len(trainer.data.dictionary), trainer.pad_id)
    model.to_empty(device="cpu")
    model.init_weights()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)

    def step(micro_batches):
        for batch in micro_batches:
            summed_cross_entropy(model, to_device(batch, torch.device("cpu")), trainer.model_inputs).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    return step


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--arch", default="llama_tiny")
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--microbatches", type=int, default=8)
    parser.add_argument("--tokens-per-sample", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--steps", type=int, default=3, help="updates per timed round")
    args = parser.parse_args()

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
        single = one_process_step(trainers["1f1b"])
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
            times["one_process"].append(timed(single, batches["1f1b"], args.steps))
        dist.barrier()

    if dist.get_rank() == 0:
        whole = statistics.median(times["one_process"])
        rows = {}
        for name, flags in SCHEDULES.items():
            step = statistics.median(times[name])
            per_rank = 2 if "--pp-stages-per-rank" in flags else 1
            stages, count = world_size, args.microbatches
            rows[name] = {
                "step_s_median": round(step, 4),
                "speedup_vs_one_process": round(whole / step, 3),
                "idle_fraction_measured": round(1 - whole / world_size / step, 3),
                "bubble_theory": round((stages - 1) / (count + stages - 1) / per_rank, 3),
            }
        print(json.dumps({
            "benchmark": "pipeline", "world_size": world_size, "arch": args.arch, "layers": args.layers,
            "batch_size": args.batch_size, "microbatches": args.microbatches,
            "tokens_per_sample": args.tokens_per_sample, "rounds": args.rounds, "steps_per_round": args.steps,
            "one_process_step_s_median": round(whole, 4), "schedules": rows,
        }, indent=2))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
    exit_without_teardown(0)  # gloo threads may outlive main(); see its docstring
