"""Tokens per second of a mixture of experts: expert parallel against one process and against
the dense model of the same active size, and the grouped GEMM against the loop over experts.

    python benchmarks/moe.py [--rounds 3 --steps 3 --dim 256 --layers 4 --experts 8 --top-k 2 --expert-ffn 512]

Every variant is a full distlm Trainer on the same global batch of the default corpus (fixed
blocks, no padding), fp32 on the CPU:

- one process: ``moe-grouped`` (the experts as one ``torch._grouped_mm``, the backend's choice
  here), ``moe-loop`` (the same model with its experts run in a loop), ``dense`` (Llama's blocks
  with one SwiGLU of ``top_k x expert-ffn``: the parameters a token of the MoE uses, less its
  router and query/key norms);
- 2 ranks: ``moe-ep2`` (--ep-degree 2), ``moe-ddp2`` (the experts replicated, DDP), ``dense-ddp2``.

Each round launches one torchrun of each world size (the order alternates every round) and
each launch times its variants in turn after a warm-up update, because this machine is shared
and noisy: the report gives medians over rounds and ratios. Prints one JSON object on stdout.
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

WORLD_VARIANTS = {
    1: ("moe-grouped", "moe-loop", "dense"),
    2: ("moe-ep2", "moe-ddp2", "dense-ddp2"),
}


def model_flags(args: argparse.Namespace, variant: str) -> list[str]:
    shape = ["--decoder-layers", str(args.layers), "--decoder-embed-dim", str(args.dim),
             "--decoder-attention-heads", str(args.heads), "--kv-heads", str(args.heads)]
    if variant.startswith("dense"):
        return ["--arch", "llama_tiny", *shape, "--decoder-ffn-embed-dim", str(args.top_k * args.expert_ffn)]
    return ["--arch", "qwen3_moe_tiny", *shape, "--num-experts", str(args.experts), "--moe-top-k", str(args.top_k),
            "--moe-ffn-dim", str(args.expert_ffn), *(["--ep-degree", "2"] if variant == "moe-ep2" else [])]


def worker(args: argparse.Namespace) -> None:
    """One launch: every variant of this world size, a warm-up update, then ``steps`` timed updates each."""
    import torch.distributed as dist

    from distlm.config import parse_args
    from distlm.errors import exit_without_teardown
    from distlm.models.moe.model import moe_layers
    from distlm.training.trainer import Trainer

    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    base = ["--tokens-per-sample", str(args.tokens_per_sample), "--sample-break-mode", "none", "--dropout", "0",
            "--attention-dropout", "0", "--no-save", "--device", "cpu", "--max-update", "1000000",
            "--log-interval", "1000000", "--batch-size", str(args.global_batch // world_size), "--seed", "1"]
    seconds = {}
    for variant in WORLD_VARIANTS[world_size]:
        trainer = Trainer(parse_args(base + model_flags(args, variant)))
        if variant == "moe-loop":
            for layer in moe_layers(trainer.model):
                layer.experts.grouped_mm = False
        loader = trainer.update_batches()
        batches = [next(loader) for _ in range(args.steps + 1)]
        trainer.train_step(batches[0])  # warm-up: first allocations
        if dist.is_initialized():
            dist.barrier()
        start = time.perf_counter()
        for batch in batches[1:]:
            trainer.train_step(batch)
        if dist.is_initialized():
            dist.barrier()
        seconds[variant] = (time.perf_counter() - start) / args.steps
        parameters = sum(p.numel() for p in trainer.model.parameters())
        seconds[f"{variant}:parameters"] = parameters
    if int(os.environ.get("RANK", "0")) == 0:
        print(json.dumps(seconds), flush=True)
    if dist.is_initialized():
        dist.barrier()
    exit_without_teardown(0)


def launch(args: argparse.Namespace, world_size: int) -> dict:
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(world_size),
               str(Path(__file__).resolve()), "--worker", *sys.argv[1:]]
    done = subprocess.run(command, capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"},
                          timeout=1800)
    if done.returncode != 0:
        raise SystemExit(f"benchmarks/moe.py: the {world_size}-rank launch failed (status {done.returncode}):\n"
                         f"{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dim", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--experts", type=int, default=8)
    parser.add_argument("--top-k", type=int, default=2)
    parser.add_argument("--expert-ffn", type=int, default=512)
    parser.add_argument("--global-batch", type=int, default=8)
    parser.add_argument("--tokens-per-sample", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=3, help="timed updates per variant and launch")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args)
        return
    times: dict[str, list[float]] = {}
    parameters: dict[str, int] = {}
    for round_index in range(args.rounds):
        for world_size in ((1, 2) if round_index % 2 == 0 else (2, 1)):
            for key, value in launch(args, world_size).items():
                if key.endswith(":parameters"):
                    parameters[key.removesuffix(":parameters")] = value
                else:
                    times.setdefault(key, []).append(value)
    tokens = args.global_batch * args.tokens_per_sample
    median = {variant: statistics.median(values) for variant, values in times.items()}
    from distlm.models.flops import active_matmul_parameters, matmul_parameters  # after the launches: no torch before
    from distlm.models import build_model
    import torch

    with torch.device("meta"):
        moe = build_model("qwen3_moe_tiny", vocab_size=260, dim=args.dim, n_layers=args.layers, n_heads=args.heads,
                          n_kv_heads=args.heads, n_experts=args.experts, top_k=args.top_k, moe_ffn_dim=args.expert_ffn)
    report = {
        "benchmark": "moe",
        "date": time.strftime("%Y-%m-%d"),
        "shape": {"dim": args.dim, "layers": args.layers, "heads": args.heads, "experts": args.experts,
                  "top_k": args.top_k, "expert_ffn": args.expert_ffn, "dense_ffn": args.top_k * args.expert_ffn,
                  "moe_matmul_parameters_active": active_matmul_parameters(moe),
                  "moe_matmul_parameters_total": matmul_parameters(moe)},
        "global_batch": args.global_batch, "tokens_per_sample": args.tokens_per_sample,
        "rounds": args.rounds, "steps_per_round": args.steps, "cpu_cores": os.cpu_count(),
        "variants": {variant: {"step_s_median": round(seconds, 4), "tokens_per_s": round(tokens / seconds, 1),
                               "step_s_rounds": [round(value, 4) for value in times[variant]],
                               "parameters": parameters[variant]}
                     for variant, seconds in median.items()},
        "ratios": {
            "grouped_over_loop_tokens_per_s": round(median["moe-loop"] / median["moe-grouped"], 3),
            "ep2_over_one_process_tokens_per_s": round(median["moe-grouped"] / median["moe-ep2"], 3),
            "ep2_over_moe_ddp2_tokens_per_s": round(median["moe-ddp2"] / median["moe-ep2"], 3),
            "moe_over_dense_one_process_tokens_per_s": round(median["dense"] / median["moe-grouped"], 3),
            "ep2_over_dense_ddp2_tokens_per_s": round(median["dense-ddp2"] / median["moe-ep2"], 3),
        },
    }
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
