"""distlm's DDP step time against a hand-written raw torch DDP loop, interleaved.

    torchrun --nproc_per_node 2 benchmarks/ddp_step.py [--rounds 12 --steps 5]
    torchrun --nproc_per_node 2 benchmarks/ddp_step.py --compile --bf16   # adds distlm with each
    mpiexec -n 2 python benchmarks/ddp_step.py --mpi     # adds distlm with --comm-transport mpi

The loops train the same model from the same weights on the same pre-collated
batches, so the difference is what distlm adds per update (global token count,
unscale/clip/finite check, schedule, bookkeeping), or what --compile and --bf16 change.
distlm runs AdamW's fused kernel on the CPU, the raw loop the foreach one a user would
write; a second raw loop with the fused kernel (``raw_fused``) shows what the kernel alone gives.
This machine is noisy, so the contenders alternate round by round (the order rotates
every round) and the report gives medians and the median of the per-round ratios
against distlm's eager fp32 update. Prints one JSON object (rank 0).
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
from distlm.training.builder import parallel_options
from distlm.models import build_model
from distlm.optim import AdamWSettings
from distlm.parallel.api import parallelize
from distlm.state.names import unwrap
from distlm.errors import exit_without_teardown
from distlm.training.trainer import Trainer


def raw_ddp_loop(trainer: Trainer, bucket_cap_mb: float, kernel: str = "foreach"):
    """The loop a user would write by hand with torch DDP: same model, optimizer, loss and clipping;
    ``kernel``: AdamW's, ``foreach`` or ``fused``."""
    reference = unwrap(trainer.model)
    model = build_model(trainer.config.model.arch, vocab_size=len(trainer.data.dictionary), dropout=0.0, attention_dropout=0.0)
    model.load_state_dict(reference.state_dict())
    model = DistributedDataParallel(model, bucket_cap_mb=bucket_cap_mb)
    cfg = trainer.config.optim
    optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.lr, betas=cfg.adam_betas, eps=cfg.adam_eps,
                                  weight_decay=cfg.weight_decay, **{kernel: True})
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
    options = parallel_options(trainer.config, trainer.ctx)
    options = dataclasses.replace(options, layout=dataclasses.replace(options.layout, comm_transport="mpi"))
    model, handle = parallelize(copy.deepcopy(unwrap(trainer.model)), trainer.ctx.dims, trainer.ctx.device, options)
    optimizer = handle.build_optimizer(AdamWSettings.from_config(trainer.config.optim), torch.float32)

    # The trainer's own update, pointed at the MPI replica.
    return dataclasses.replace(trainer.update, model=model, handle=handle, optimizer=optimizer)


def variant_step(trainer: Trainer, steps: int):
    """A Trainer of another setting, stepping through its own copy of the same batches
    (a compiled run pads them to one length, so it needs its own)."""
    loader = trainer.update_batches()
    own = [next(loader) for _ in range(steps)]
    calls = iter(range(1 << 62))

    def step(_batch):
        trainer.train_step(own[next(calls) % len(own)])

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
    parser.add_argument("--compile", action="store_true", help="also time distlm's update with --compile")
    parser.add_argument("--bf16", action="store_true", help="also time distlm's update with --bf16")
    args = parser.parse_args()

    flags = [
        "--arch", args.arch, "--batch-size", str(args.batch_size), "--tokens-per-sample", str(args.tokens_per_sample),
        "--bucket-cap-mb", str(args.bucket_cap_mb), "--dropout", "0", "--attention-dropout", "0",
        "--no-save", "--device", "cpu", "--max-update", "1000000", "--disable-validation",
    ]
    trainer = Trainer(parse_args(flags))
    raw_step = raw_ddp_loop(trainer, args.bucket_cap_mb)
    raw_fused_step = raw_ddp_loop(trainer, args.bucket_cap_mb, "fused")
    loader = trainer.update_batches()
    batches = [next(loader) for _ in range(args.steps)]

    # Warm-up: first-iteration allocations and DDP's bucket rebuild, for both.
    timed(trainer.train_step, batches, 2)
    timed(raw_step, batches, 2)
    timed(raw_fused_step, batches, 2)

    contenders = {"distlm": trainer.train_step, "raw": raw_step, "raw_fused": raw_fused_step}
    if args.mpi:
        contenders["distlm_mpi"] = mpi_transport_step(trainer)
    for name, extra in (("distlm_compile", ["--compile"]), ("distlm_bf16", ["--bf16"])):
        if getattr(args, name.removeprefix("distlm_")):
            contenders[name] = variant_step(Trainer(parse_args(flags + extra)), args.steps)
    for name in list(contenders)[3:]:
        timed(contenders[name], batches, 2)  # warm-up: compilation happens here
    times = {name: [] for name in contenders}
    for round_index in range(args.rounds):
        order = list(contenders.items())
        shift = round_index % len(order)
        for name, step in order[shift:] + order[:shift]:
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
        variants = {
            f"{name}_over_eager_fp32_{kind}": round(value, 4)
            for name in times if name.startswith("distlm_") and name != "distlm_mpi"
            for kind, value in (
                ("ratio_of_medians", statistics.median(times[name]) / statistics.median(distlm_times)),
                ("median_of_round_ratios", statistics.median(v / d for v, d in zip(times[name], distlm_times))),
            )
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
            "raw_fused_adamw_step_s_median": round(statistics.median(times["raw_fused"]), 5),
            "raw_fused_over_raw_median_of_round_ratios": round(
                statistics.median(f / r for f, r in zip(times["raw_fused"], raw_times)), 4),
            **transport,
            **variants,
        }, indent=2))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
    exit_without_teardown(0)  # gloo threads may outlive main(); see its docstring
