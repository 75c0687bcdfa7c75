"""distlm's DDP step time against a hand-written raw torch DDP loop, interleaved.

    torchrun --nproc_per_node 2 benchmarks/ddp_step.py [--rounds 12 --steps 5]

Both loops train the same model from the same weights on the same pre-collated
batches, so the difference is what distlm adds per update (global token count,
unscale/clip/finite check, schedule, bookkeeping). This machine is noisy, so the two
alternate round by round (the order flips every round) and the report gives medians
and the median of the per-round ratios. Prints one JSON object (rank 0).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel

from distlm.config import parse_args
from distlm.models import build_model
from distlm.parallel.api import unwrap
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

    distlm_times, raw_times = [], []
    for round_index in range(args.rounds):
        order = [("distlm", trainer.train_step), ("raw", raw_step)]
        if round_index % 2:
            order.reverse()
        for name, step in order:
            (distlm_times if name == "distlm" else raw_times).append(timed(step, batches, args.steps))

    if dist.get_rank() == 0:
        ratios = [d / r for d, r in zip(distlm_times, raw_times)]
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
        }, indent=2))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
