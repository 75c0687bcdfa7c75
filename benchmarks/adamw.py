"""AdamW's step on the CPU: torch's fused kernel against its foreach (multi-tensor) kernel.

    OMP_NUM_THREADS=1 python benchmarks/adamw.py [--rounds 15]

Two parameter sets, each with one gradient per tensor: the seed's everyday RoBERTa (2 layers,
128 wide, 16,001-row embedding; 2.46M parameters) and roberta_base's embedding with 2 of its
layers (52.8M). Per set, one optimizer of each kind steps alternately (the order flips every
round, as this machine is shared), after one warm-up step each that allocates the moments.
Prints one JSON object: per set the median milliseconds of each kernel and the ratio
foreach / fused, the thread count and the load average.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import torch

SETS = {
    "roberta_2x128": [(16001, 128), (130, 128)] + [(128, 128)] * 8 + [(512, 128), (128, 512)] * 2 + [(128,)] * 30,
    "roberta_base_2_layers": [(50265, 768)] + [(768, 768)] * 8 + [(3072, 768), (768, 3072)] * 2 + [(768,)] * 20,
}
KERNELS = ("foreach", "fused")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=15)
    args = parser.parse_args()
    torch.manual_seed(0)
    report: dict = {"benchmark": "adamw", "rounds": args.rounds, "threads": torch.get_num_threads()}
    for name, shapes in SETS.items():
        optimizers = {}
        for kernel in KERNELS:
            params = [torch.nn.Parameter(torch.randn(shape)) for shape in shapes]
            for param in params:
                param.grad = torch.randn_like(param)
            optimizers[kernel] = torch.optim.AdamW(params, lr=1e-3, weight_decay=0.01, **{kernel: True})
            optimizers[kernel].step()
        times: dict[str, list[float]] = {kernel: [] for kernel in KERNELS}
        for round_index in range(args.rounds):
            for kernel in KERNELS if round_index % 2 else reversed(KERNELS):
                start = time.perf_counter()
                optimizers[kernel].step()
                times[kernel].append(time.perf_counter() - start)
        medians = {kernel: statistics.median(values) for kernel, values in times.items()}
        report[name] = {"parameters": sum(param.numel() for param in optimizers["fused"].param_groups[0]["params"]),
                        **{f"{kernel}_ms": round(seconds * 1e3, 2) for kernel, seconds in medians.items()},
                        "foreach_over_fused": round(medians["foreach"] / medians["fused"], 2)}
    report["load_average"] = os.getloadavg()
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
