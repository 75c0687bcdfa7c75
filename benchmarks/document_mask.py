"""Attention over packed documents: SDPA with a block-diagonal causal mask against the path
that runs each document on its own, forward and backward of one Llama attention layer.

    python benchmarks/document_mask.py --device cuda     # masked SDPA vs torch.nn.attention.varlen
    python benchmarks/document_mask.py --device cpu      # masked SDPA vs a loop over the documents

On CUDA the other path is the one ``--document-mask`` trains with there, varlen attention
(flash attention over the documents' offsets, bf16 by default); on CPU, where that kernel does
not run, it is a loop that runs the layer on each document alone. The layer is distlm's
``LlamaAttention`` (projections, rotary embeddings with positions restarting per document,
attention, output projection) on ``--batch`` rows of ``--tokens`` tokens, each row cut into
``--documents`` documents at seeded random places. The mask and the offsets are built once,
outside the timing, as a model builds them once for all its layers.

The paths run interleaved, ``--reps`` times each after ``--warmup`` runs, in an order rotated
every rep, and each line gives the median (and the fastest) milliseconds of one forward and
backward. First a line compares the paths' outputs and input gradients. One JSON object per
line; a path that cannot run prints a line with its ``error`` and the others still run.
Needs only torch and distlm (this checkout's, installed or not).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

# The checkout's distlm, installed or not: the code beside this script is what is measured.
CHECKOUT = Path(__file__).resolve().parent.parent
if (CHECKOUT / "distlm").is_dir():
    sys.path.insert(0, str(CHECKOUT))

from distlm.models.llama.model import (
    # noqa: E402     LlamaAttention,
    document_cu_seqlens,
    document_positions_and_mask,
    rotary_tables,
    varlen_unavailable,
)
from distlm.models.llama.config import LlamaConfig

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--tokens", type=int, help="tokens per row (default 4096 on cuda, 1024 on cpu)")
    parser.add_argument("--documents", type=int, default=8, help="documents per row (default 8)")
    parser.add_argument("--batch", type=int, default=1, help="rows (default 1)")
    parser.add_argument("--heads", type=int, help="query heads (default 32 on cuda, 8 on cpu)")
    parser.add_argument("--kv-heads", type=int, help="key/value heads (default 8 on cuda, 2 on cpu)")
    parser.add_argument("--head-dim", type=int, default=128, help="head size (default 128)")
    parser.add_argument("--dtype", choices=tuple(DTYPES), help="default bf16 on cuda, fp32 on cpu")
    parser.add_argument("--reps", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    cuda = args.device == "cuda"
    args.tokens = args.tokens or (4096 if cuda else 1024)
    args.heads = args.heads or (32 if cuda else 8)
    args.kv_heads = args.kv_heads or (8 if cuda else 2)
    args.dtype = args.dtype or ("bf16" if cuda else "fp32")
    if not 1 <= args.documents <= args.tokens:
        parser.error(f"--documents {args.documents} must be between 1 and --tokens {args.tokens}")
    return args


def document_ids(batch: int, tokens: int, documents: int, generator: torch.Generator) -> torch.Tensor:
    """Rows of ``documents`` runs, cut at distinct random places."""
    rows = []
    for _ in range(batch):
        cuts = torch.randperm(tokens - 1, generator=generator)[: documents - 1] + 1
        starts = torch.zeros(tokens, dtype=torch.long)
        starts[cuts] = 1
        rows.append(starts.cumsum(0))
    return torch.stack(rows)


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    device, dtype = torch.device(args.device), DTYPES[args.dtype]
    generator = torch.Generator().manual_seed(args.seed)
    config = LlamaConfig(dim=args.heads * args.head_dim, n_heads=args.heads, n_kv_heads=args.kv_heads,
                         vocab_size=1, max_seq_len=args.tokens)
    torch.manual_seed(args.seed)
    layer = LlamaAttention(config).to(device=device, dtype=dtype)
    ids = document_ids(args.batch, args.tokens, args.documents, generator)
    positions, mask = document_positions_and_mask(ids)
    cos, sin = rotary_tables(args.head_dim, args.tokens, config.rope_theta)
    cos, sin = cos[positions].to(device), sin[positions].to(device)
    mask, offsets = mask.to(device), document_cu_seqlens(ids).to(device)
    x = torch.randn(args.batch, args.tokens, config.dim, generator=generator).to(device=device, dtype=dtype)
    grad_out = torch.randn(x.shape, generator=generator).to(device=device, dtype=dtype)
    bounds = [(row, int(a), int(b)) for row in range(args.batch)
              for a, b in zip(*_row_bounds(ids[row]))]

    def masked_sdpa(inputs):
        return layer(inputs, cos, sin, mask)

    def varlen(inputs):
        return layer(inputs, cos, sin, offsets)

    def per_document(inputs):
        # Each document alone: its own rows of x, its rotary angles from 0, plain causal attention.
        parts = [layer(inputs[row:row + 1, a:b], cos[row, a:b], sin[row, a:b]) for row, a, b in bounds]
        rows = [torch.cat([part for (r, _, _), part in zip(bounds, parts) if r == row], dim=1)
                for row in range(args.batch)]
        return torch.cat(rows)

    other = ("varlen", varlen) if device.type == "cuda" else ("per_document", per_document)
    paths = {"sdpa_mask": masked_sdpa, other[0]: other[1]}
    facts = {"benchmark": "document_mask", "device": _device_name(device), "torch": torch.__version__,
             "dtype": args.dtype, "batch": args.batch, "tokens": args.tokens, "documents": args.documents,
             "heads": args.heads, "kv_heads": args.kv_heads, "head_dim": args.head_dim}
    if other[0] == "varlen":
        reason = varlen_unavailable(config, device, dtype)
        if reason is not None:
            print(json.dumps({**facts, "path": "varlen", "error": f"varlen attention cannot run: {reason}"}), flush=True)
            del paths["varlen"]

    def run(path: str):
        inputs = x.detach().requires_grad_()
        layer.zero_grad(set_to_none=True)
        out = paths[path](inputs)
        out.backward(grad_out)
        return out.detach(), inputs.grad

    failed = set()
    results = {}
    for path in list(paths):
        try:
            results[path] = run(path)
        except Exception as exc:  # noqa: BLE001 - reported as the path's line, the others still run
            print(json.dumps({**facts, "path": path, "error": f"{type(exc).__name__}: {str(exc).splitlines()[0]}"}),
                  flush=True)
            failed.add(path)
    if len(results) == 2:
        (out_a, grad_a), (out_b, grad_b) = results.values()
        print(json.dumps({**facts, "check": " vs ".join(results), "max_abs_out": float(out_a.abs().max()),
                          "max_abs_out_diff": float((out_a.float() - out_b.float()).abs().max()),
                          "max_abs_grad": float(grad_a.abs().max()),
                          "max_abs_grad_diff": float((grad_a.float() - grad_b.float()).abs().max())}), flush=True)
    names = [path for path in paths if path not in failed]
    times: dict[str, list[float]] = {path: [] for path in names}
    for rep in range(args.warmup + args.reps):
        for k in range(len(names)):
            path = names[(rep + k) % len(names)]
            synchronize(device)
            started = time.perf_counter()
            run(path)
            synchronize(device)
            if rep >= args.warmup:
                times[path].append((time.perf_counter() - started) * 1e3)
    medians = {path: statistics.median(values) for path, values in times.items()}
    for path, values in times.items():
        line = {**facts, "path": path, "median_ms": round(medians[path], 4), "min_ms": round(min(values), 4),
                "reps": len(values)}
        if path != "sdpa_mask" and "sdpa_mask" in medians:
            line["speedup_over_sdpa_mask"] = round(medians["sdpa_mask"] / medians[path], 3)
        print(json.dumps(line), flush=True)
    return 0


def _row_bounds(row: torch.Tensor) -> tuple[list[int], list[int]]:
    starts = torch.nonzero(torch.cat([torch.ones(1, dtype=torch.bool), row[1:] != row[:-1]])).flatten().tolist()
    return starts, starts[1:] + [len(row)]


def _device_name(device: torch.device) -> str:
    return torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"


if __name__ == "__main__":
    sys.exit(main())
