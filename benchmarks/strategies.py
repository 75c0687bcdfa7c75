"""Step time and per-rank memory of each strategy on the same model and global batch, side by side.

    torchrun --nproc_per_node 2 benchmarks/strategies.py [--arch llama_tiny --rounds 8 --steps 3]
    torchrun --nproc_per_node 4 benchmarks/strategies.py     # adds fsdp/zero1 x tp2 (2-D) from 4 ranks on

Every strategy is a full distlm Trainer in the same process group, trained on the same
global batch; rounds alternate between them (the order rotates every round) because this
machine is noisy, and the report gives medians and ratios to DDP. Memory is measured on
each rank's own tensors (parameters, gradients, optimizer state) after an update, before
gradients are freed. Prints one JSON object (rank 0).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch.distributed as dist

from distlm.config import parse_args
from distlm.mesh import ParallelDims
from distlm.training.trainer import Trainer
from distlm.errors import exit_without_teardown


def strategies(world_size: int) -> dict[str, list[str]]:
    """Name -> flags; --batch-size is set per data-parallel replica below. The 2-D
    combinations need two data-parallel replicas of a tp2 model, so 4 ranks or more."""
    runs = {"ddp": [], "zero1": ["--strategy", "zero1"], "fsdp": ["--strategy", "fsdp"],
            "ddp-tp2": ["--tp-degree", "2"]}
    if world_size >= 4 and world_size % 2 == 0:
        runs["fsdp-tp2"] = ["--strategy", "fsdp", "--tp-degree", "2"]
        runs["zero1-tp2"] = ["--strategy", "zero1", "--tp-degree", "2"]
    return runs


def dp_degree(flags: list[str], world_size: int) -> int:
    tp = int(flags[flags.index("--tp-degree") + 1]) if "--tp-degree" in flags else 1
    return ParallelDims(world_size=world_size, tp=tp).dp


def timed(trainer: Trainer, batches, steps: int) -> float:
    dist.barrier()
    start = time.perf_counter()
    for i in range(steps):
        trainer.train_step(batches[i % len(batches)])
    dist.barrier()
    return (time.perf_counter() - start) / steps


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--arch", default="llama_tiny")
    parser.add_argument("--global-batch", type=int, default=16)
    parser.add_argument("--tokens-per-sample", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--steps", type=int, default=3, help="updates per timed round")
    args = parser.parse_args()

    base = ["--arch", args.arch, "--tokens-per-sample", str(args.tokens_per_sample), "--dropout", "0",
            "--attention-dropout", "0", "--no-save", "--device", "cpu", "--max-update", "1000000",
            "--log-interval", "1"]
    world_size = int(__import__("os").environ["WORLD_SIZE"])
    trainers, batches = {}, {}
    for name, flags in strategies(world_size).items():
        batch = args.global_batch // dp_degree(flags, world_size)
        trainers[name] = Trainer(parse_args(base + flags + ["--batch-size", str(batch)]))
        loader = trainers[name].update_batches()
        batches[name] = [next(loader) for _ in range(args.steps)]
        timed(trainers[name], batches[name], 1)  # warm-up: first allocations, bucket rebuilds

    times = {name: [] for name in trainers}
    names = list(trainers)
    for round_index in range(args.rounds):
        shift = round_index % len(names)
        for name in names[shift:] + names[:shift]:
            times[name].append(timed(trainers[name], batches[name], args.steps))

    memory = {}
    for name, trainer in trainers.items():
        everyone = [None] * world_size
        dist.all_gather_object(everyone, trainer.last_memory)
        memory[name] = everyone
    if dist.get_rank() == 0:
        ddp = statistics.median(times["ddp"])
        report = {
            "benchmark": "strategies",
            "world_size": world_size,
            "arch": args.arch,
            "global_batch": args.global_batch,
            "tokens_per_sample": args.tokens_per_sample,
            "rounds": args.rounds,
            "steps_per_round": args.steps,
            "strategies": {
                name: {
                    "step_s_median": round(statistics.median(times[name]), 4),
                    "step_time_vs_ddp": round(statistics.median(times[name]) / ddp, 3),
                    "memory_bytes_per_rank": memory[name],
                }
                for name in trainers
            },
        }
        print(json.dumps(report, indent=2))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
    exit_without_teardown(0)  # gloo threads may outlive main(); see its docstring
