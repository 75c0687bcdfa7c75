"""distlm's DDP step time against a hand-written raw torch DDP loop, interleaved.

    torchrun --nproc_per_node 2 benchmarks/ddp_step.py [--rounds 12 --steps 5]
    mpiexec -n 2 python benchmarks/ddp_step.py --mpi     # adds distlm with --comm-transport mpi

Both loops train the same model from the same weights on the same pre-collated
batches, so the difference is what distlm adds per update (global token count,
unscale/clip/finite check, schedule, bookkeeping). This machine is noisy, so the two
alternate round by round (the order flips every round) and the report gives medians
and the median of the per-round ratios. Prints one JSON object (rank 0).
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import json
import statistics
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel

from distlm.config import parse_args
from distlm.models import build_model
from distlm.optim import build_optimizer
from distlm.parallel.api import build_comm_hook, parallelize, unwrap
from distlm.train import exit_without_teardown
from distlm.trainer import Trainer


def raw_ddp_loop(trainer: Trainer, bucket_cap_mb: float):
    """The loop a user would write by hand with torch DDP: same model, optimizer, loss and clipping."""
    reference = unwrap(trainer.model)
    model = build_model(trainer.config.model.arch, vocab_size=len(trainer.data.dictionary), dropout=0.0, attention_dropout=0.0)
    model.load_state_dict(reference.state_dict())
    model = DistributedDataParallel(model, bucket_cap_mb=bucket_cap_mb)
    cfg = trainer.config.optim
    optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.lr, betas=cfg.adam_betas, eps=cfg.adam_eps,
                                  weight_decay=cfg.weight_decay, foreach=True)
    masked_lm = trainer.task == "masked_lm"

    def step(micro_batches):
        for batch in micro_batches:
            targets = batch["targets"]
            if masked_lm:
                mask = targets.ne(-100)
                logits, targets = model(batch["input_ids"], masked_tokens=mask), targets[mask]
            else:
                logits = model(batch["input_ids"])
            loss = F.cross_entropy(logits.reshape(-1, logits.size(-1)), targets.reshape(-1), ignore_index=-100)
            loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.clip_norm, foreach=True)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    return step


def mpi_transport_step(trainer: Trainer):
    """distlm's own update on a second DDP replica of the model whose buckets go through mpi4py."""
    mpi_cfg = dataclasses.replace(trainer.config.distributed, comm_transport="mpi")
    hook = build_comm_hook(mpi_cfg, trainer.dims, trainer.env.local_world_size, trainer.device.type)
    model = parallelize(copy.deepcopy(unwrap(trainer.model)), trainer.dims, mpi_cfg, trainer.device, hook)
    optimizer = build_optimizer(model.parameters(), trainer.config.optim, torch.float32)

    def step(micro_batches):
        # The same Trainer.train_step, pointed at the MPI replica for the duration of one update.
        saved = trainer.model, trainer.optimizer
        trainer.model, trainer.optimizer = model, optimizer
        try:
            trainer.train_step(micro_batches)
        finally:
            trainer.model, trainer.optimizer = saved

    return step


def timed(step, batches, steps: int) -> float:
    dist.barrier()
    start = time.perf_counter()
    for i in range(steps):
        step(batches[i % len(batches)])
    dist.barrier()
    return (time.perf_counter() - start) / steps


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=12)
    parser.add_argument("--steps", type=int, default=5, help="updates per timed round")
    parser.add_argument("--arch", default="roberta_tiny")
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--tokens-per-sample", type=int, default=128)
    parser.add_argument("--bucket-cap-mb", type=float, default=25.0)
    parser.add_argument("--mpi", action="store_true", help="under mpiexec: also time distlm's update with --comm-transport mpi")
    args = parser.parse_args()

    config = parse_args([
        "--arch", args.arch, "--batch-size", str(args.batch_size), "--tokens-per-sample", str(args.tokens_per_sample),
        "--bucket-cap-mb", str(args.bucket_cap_mb), "--dropout", "0", "--attention-dropout", "0",
        "--no-save", "--device", "cpu", "--max-update", "1000000",
    ])
    trainer = Trainer(config)
    raw_step = raw_ddp_loop(trainer, args.bucket_cap_mb)
    loader = trainer.update_batches()
    batches = [next(loader) for _ in range(args.steps)]

    # Warm-up: first-iteration allocations and DDP's bucket rebuild, for both.
    timed(trainer.train_step, batches, 2)
    timed(raw_step, batches, 2)

    contenders = {"distlm": trainer.train_step, "raw": raw_step}
    if args.mpi:
        contenders["distlm_mpi"] = mpi_transport_step(trainer)
        timed(contenders["distlm_mpi"], batches, 2)
    times = {name: [] for name in contenders}
    for round_index in range(args.rounds):
        order = list(contenders.items())
        if round_index % 2:
            order.reverse()
        for name, step in order:
            times[name].append(timed(step, batches, args.steps))
    distlm_times, raw_times = times["distlm"], times["raw"]

    if dist.get_rank() == 0:
        ratios = [d / r for d, r in zip(distlm_times, raw_times)]
        transport = {}
        if args.mpi:
            transport = {
                "distlm_mpi_step_s_median": round(statistics.median(times["distlm_mpi"]), 5),
                "mpi_over_gloo_ratio_of_medians": round(statistics.median(times["distlm_mpi"]) / statistics.median(distlm_times), 4),
                "mpi_over_gloo_median_of_round_ratios": round(
                    statistics.median(m / g for m, g in zip(times["distlm_mpi"], distlm_times)), 4),
            }
        print(json.dumps({
            "benchmark": "ddp_step",
            "world_size": dist.get_world_size(),
            "arch": args.arch,
            "batch_size_per_rank": args.batch_size,
            "tokens_per_sample": args.tokens_per_sample,
            "bucket_cap_mb": args.bucket_cap_mb,
            "rounds": args.rounds,
            "steps_per_round": args.steps,
            "distlm_step_s_median": round(statistics.median(distlm_times), 5),
            "raw_ddp_step_s_median": round(statistics.median(raw_times), 5),
            "ratio_of_medians": round(statistics.median(distlm_times) / statistics.median(raw_times), 4),
            "median_of_round_ratios": round(statistics.median(ratios), 4),
            **transport,
        }, indent=2))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
    exit_without_teardown(0)  # gloo threads may outlive main(); see its docstring
