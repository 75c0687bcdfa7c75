"""fp32 against bf16 on this CPU, at roberta_base's and a ~125M Llama's shapes: what the
matrix hardware gives, what distlm's training update gets, and where the bf16 update's time goes.

    python benchmarks/cpu_precision.py [--parts ceiling,update,profile] [--threads 1,2] [--rounds 3]

Each model trains with its architecture's own dropouts, as a user's run does: RoBERTa's 0.1
(attention dropout included), Llama's none.

- ``ceiling``: one block's linear-layer matrix multiplies (forward, input gradient, weight
  gradient, with the transposes autograd hands them) and its attention (forward and backward,
  with the model's attention dropout), each in fp32 and bf16, on each thread count. Attention
  runs as distlm runs it (SDPA under the precision's context), as torch runs it by default (SDPA
  alone: its math backend upcasts bf16 to fp32), and unfused (matmul-softmax-matmul in bf16,
  scores rounded to bf16); each one's error against float64 is measured too.
- ``update``: distlm's whole update (forward, backward, clip, AdamW) from the command line,
  fp32 against ``--bf16`` (autocast, fp32 weights), tokens per second; for a model with attention
  dropout also ``--bf16`` with torch's default attention (``bf16_torch_attention``).
- ``profile``: one update per precision under torch.profiler, grouped by kind of work, the top
  ops of the bf16 update, and the oneDNN kernels each dispatched (``torch.backends.mkldnn.verbose``,
  as ``ONEDNN_VERBOSE=1`` shows them) with the ISA oneDNN reports; fp32's matrix multiplies go to
  MKL, not oneDNN.

fp16 joins each part where the CPU has fp16 matrix instructions (amx_fp16, avx512_fp16), or with
``--fp16``; elsewhere torch multiplies fp16 matrices in a scalar loop, tens of times slower.
This machine is noisy: contenders alternate within every round (the order rotates), and the
report gives medians and ratios. Prints one JSON object.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import ctypes
import dataclasses
import datetime
import gc
import json
import os
import platform
import re
import statistics
import tempfile
import time
from typing import Callable

import torch
import torch.nn.functional as F

from distlm.backends.hardware import cpu_half_precision_flags, cpu_half_precision_path, cpu_model_and_flags
from distlm.config import parse_args
from distlm.precision import DTYPES, Precision, dtype_name, precision_flags
from distlm.training.trainer import Trainer

# Published sizes, so the embedding, the output layer and the optimizer weigh what they do in a real run.
MODELS: dict[str, list[str]] = {
    "roberta_base": ["--arch", "roberta_base", "--vocab-size", "50265"],
    "llama_125m": ["--arch", "llama_tiny", "--decoder-layers", "12", "--decoder-embed-dim", "768",
                   "--decoder-attention-heads", "12", "--kv-heads", "12", "--decoder-ffn-embed-dim", "2048",
                   "--vocab-size", "32000"],
}
TOKENS_PER_SAMPLE = 512


def run_flags(model: str, precision: str, batch_size: int) -> list[str]:
    return [*MODELS[model], *precision_flags(precision), "--tokens-per-sample", str(TOKENS_PER_SAMPLE),
            "--batch-size", str(batch_size), "--no-save", "--device", "cpu", "--max-update", "1000000",
            "--disable-validation", "--log-format", "json"]


def build_trainer(model: str, contender: str, batch_size: int) -> Trainer:
    """A Trainer of ``model`` in the contender's precision. ``bf16_torch_attention`` is ``--bf16``
    with plain autocast, as torch runs it by default: without ``Precision.autocast``'s bf16 math attention."""
    precision = "bf16" if contender == "bf16_torch_attention" else contender
    trainer = Trainer(parse_args(run_flags(model, precision, batch_size)))
    if contender == "bf16_torch_attention":
        trainer.update = dataclasses.replace(trainer.update, autocast=lambda: torch.autocast("cpu", torch.bfloat16))
    return trainer


def precisions(force_fp16: bool) -> list[str]:
    fast_fp16 = cpu_half_precision_path("fp16")[0] is not None
    return ["fp32", "bf16"] + (["fp16"] if fast_fp16 or force_fp16 else [])


def cpu_description() -> dict:
    model = cpu_model_and_flags()[0] or platform.processor()
    return {"cpu": model, "cores": os.cpu_count(), "half_precision_flags": cpu_half_precision_flags(),
            "bf16_path": cpu_half_precision_path("bf16")[1], "fp16_path": cpu_half_precision_path("fp16")[1],
            "torch": torch.__version__, "date": datetime.date.today().isoformat(),
            "load_average_at_start": [round(x, 2) for x in os.getloadavg()]}


def median_ratio(numerators: list[float], denominators: list[float]) -> float:
    return round(statistics.median(n / d for n, d in zip(numerators, denominators)), 3)


# ------------------------------------------------------------------ ceiling


@dataclasses.dataclass(frozen=True)
class Block:
    """What one block of a model multiplies: its linear weights as (out, in), and its attention."""

    weights: list[tuple[int, int]]
    heads: int
    head_dim: int
    causal: bool
    attention_dropout: float


def block_of(trainer: Trainer) -> Block:
    model = trainer.model
    weights = [tuple(m.weight.shape) for m in model.layers[0].modules() if isinstance(m, torch.nn.Linear)]
    config = model.config
    return Block(weights, config.n_heads, config.dim // config.n_heads, trainer.task == "causal_lm",
                 config.attention_dropout)


def block_matmuls(weights: list[tuple[int, int]], tokens: int, dtype: torch.dtype) -> tuple[Callable, float]:
    """The block's linear layers' three multiplies each, as autograd runs them, and their FLOPs."""
    generator = torch.Generator().manual_seed(0)
    work = []
    flops = 0.0
    for out_features, in_features in weights:
        x = torch.randn(tokens, in_features, generator=generator).to(dtype)
        w = torch.randn(out_features, in_features, generator=generator).to(dtype)
        g = torch.randn(tokens, out_features, generator=generator).to(dtype)
        work.append((x, w, g))
        flops += 3 * 2.0 * tokens * in_features * out_features

    def run():
        for x, w, g in work:
            torch.mm(x, w.t())  # forward: x W^T
            torch.mm(g, w)  # input gradient
            torch.mm(g.t(), x)  # weight gradient

    return run, flops


# How attention runs: as distlm runs it (SDPA under the precision's context), as torch runs it
# by default (SDPA alone), and unfused (matmul-softmax-matmul with every intermediate in the
# compute type: scores rounded to it, all T x T probabilities kept for backward).
ATTENTION_KINDS = ("distlm", "torch_default", "unfused")


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, block: Block, kind: str) -> torch.Tensor:
    """Training-mode attention of [B, H, T, D] queries, keys and values, the ``kind`` way."""
    if kind == "unfused":
        scores = (q * q.shape[-1] ** -0.5) @ k.transpose(-1, -2)
        if block.causal:
            tokens = q.shape[-2]
            scores = scores.masked_fill(~torch.ones(tokens, tokens, dtype=torch.bool).tril(), float("-inf"))
        return F.dropout(torch.softmax(scores, dim=-1), block.attention_dropout) @ v
    context = Precision.from_mode(dtype_name(q.dtype)).autocast("cpu") if kind == "distlm" else contextlib.nullcontext()
    with context:
        return F.scaled_dot_product_attention(q, k, v, dropout_p=block.attention_dropout, is_causal=block.causal)


def attention(block: Block, batch: int, tokens: int, dtype: torch.dtype, kind: str) -> Callable:
    """Attention forward and backward on [B, T, H, D] projections viewed as [B, H, T, D], as the models call it."""
    generator = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(batch, tokens, block.heads, block.head_dim, generator=generator).to(dtype)
               .requires_grad_() for _ in range(3))
    grad = torch.randn(batch, tokens, block.heads * block.head_dim, generator=generator).to(dtype)

    def run():
        out = attend(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), block, kind)
        out.transpose(1, 2).reshape(batch, tokens, -1).backward(grad)

    return run


def attention_errors(block: Block, tokens: int, dtype: torch.dtype) -> dict:
    """Relative error (norm of the difference over the norm) of each attention kind's output and
    query gradient in ``dtype`` against float64, for queries and keys of standard deviation 1
    and 3 (the larger, the more peaked the attention and the larger the scores). The seed is
    fixed before each call, and dropout draws its mask element by element whatever the dtype,
    so every kind drops the same positions."""
    errors = {}
    for spread in (1.0, 3.0):
        generator = torch.Generator().manual_seed(0)
        q, k = (torch.randn(1, block.heads, tokens, block.head_dim, generator=generator, dtype=torch.float64) * spread
                for _ in range(2))
        v, grad = (torch.randn(1, block.heads, tokens, block.head_dim, generator=generator, dtype=torch.float64)
                   for _ in range(2))

        def output_and_query_gradient(kind: str, as_type: torch.dtype) -> list[torch.Tensor]:
            query = q.detach().to(as_type).requires_grad_()  # a leaf of its own, also in float64
            torch.manual_seed(1)
            out = attend(query, k.to(as_type), v.to(as_type), block, kind)
            out.backward(grad.to(as_type))
            return [out.double(), query.grad.double()]

        reference = output_and_query_gradient("torch_default", torch.float64)
        for kind in ATTENTION_KINDS:
            found = output_and_query_gradient(kind, dtype)
            errors[f"{kind}_spread{spread:g}"] = [
                float(f"{((a - b).norm() / b.norm()).item():.2g}") for a, b in zip(found, reference)]
    return errors


def timed(run: Callable) -> float:
    start = time.perf_counter()
    run()
    return time.perf_counter() - start


def measure_ceiling(args, modes: list[str]) -> dict:
    report = {}
    tokens = TOKENS_PER_SAMPLE
    for model in args.models:
        trainer = build_trainer(model, "fp32", args.batch_size)
        block = block_of(trainer)
        del trainer
        gc.collect()
        contenders, flops = {}, 0.0
        for mode in modes:
            contenders[f"matmul_{mode}"], flops = block_matmuls(block.weights, args.batch_size * tokens, DTYPES[mode])
            contenders[f"attention_{mode}"] = attention(block, args.batch_size, tokens, DTYPES[mode], "distlm")
        for mode in modes[1:]:  # the other ways of running attention in the half type
            for kind in ATTENTION_KINDS[1:]:
                contenders[f"attention_{mode}_{kind}"] = attention(block, args.batch_size, tokens, DTYPES[mode], kind)
        times = {(threads, name): [] for threads in args.threads for name in contenders}
        for threads in args.threads:  # warm-up: oneDNN builds its kernels for each shape on first use
            torch.set_num_threads(threads)
            for run in contenders.values():
                run()
        for round_index in range(args.rounds):
            for threads in args.threads:
                torch.set_num_threads(threads)
                order = list(contenders.items())
                shift = round_index % len(order)
                for name, run in order[shift:] + order[:shift]:
                    times[threads, name].append(timed(run))
        for threads in args.threads:
            entry = {"linear_matmul_gflop": round(flops / 1e9, 2), "attention_causal": block.causal,
                     "attention_dropout": block.attention_dropout}
            for mode in modes:
                matmul_s = statistics.median(times[threads, f"matmul_{mode}"])
                entry[f"matmul_{mode}_gflops"] = round(flops / matmul_s / 1e9, 1)
                entry[f"attention_{mode}_ms"] = round(statistics.median(times[threads, f"attention_{mode}"]) * 1e3, 1)
            for mode in modes[1:]:
                entry[f"matmul_{mode}_over_fp32_speed"] = median_ratio(times[threads, "matmul_fp32"],
                                                                       times[threads, f"matmul_{mode}"])
                entry[f"attention_{mode}_over_fp32_speed"] = median_ratio(times[threads, "attention_fp32"],
                                                                          times[threads, f"attention_{mode}"])
                for kind in ATTENTION_KINDS[1:]:
                    name = f"attention_{mode}_{kind}"
                    entry[f"{name}_ms"] = round(statistics.median(times[threads, name]) * 1e3, 1)
                    entry[f"{name}_over_fp32_speed"] = median_ratio(times[threads, "attention_fp32"],
                                                                    times[threads, name])
            report[f"{model}_threads{threads}"] = entry
        for mode in modes[1:]:
            report[f"{model}_attention_{mode}_error_output_query_grad"] = attention_errors(block, tokens, DTYPES[mode])
    return report


# ------------------------------------------------------------------ update


def update_runner(trainer: Trainer, steps: int) -> Callable:
    """``steps`` updates over a fixed set of the trainer's own batches (the same data for every
    precision: each trainer's loader starts from the same seed)."""
    loader = trainer.update_batches()
    batches = [next(loader) for _ in range(steps)]

    def run():
        for batch in batches:
            trainer.train_step(batch)

    return run


def contenders_of(model: str, modes: list[str], batch_size: int) -> list[str]:
    """The precisions, and bf16 with torch's default attention where the model has attention dropout."""
    trainer = build_trainer(model, "fp32", batch_size)
    dropout = trainer.model.config.attention_dropout
    del trainer
    gc.collect()
    return modes + (["bf16_torch_attention"] if dropout > 0 and "bf16" in modes else [])


def measure_updates(args, modes: list[str]) -> dict:
    report = {}
    for model in args.models:
        modes_here = contenders_of(model, modes, args.batch_size)
        runs = {}
        for mode in modes_here:
            runs[mode] = update_runner(build_trainer(model, mode, args.batch_size), args.steps)
        for threads in args.threads:  # warm-up: optimizer state, oneDNN kernels for every shape of the batches
            torch.set_num_threads(threads)
            for run in runs.values():
                run()
        times = {(threads, mode): [] for threads in args.threads for mode in modes_here}
        for round_index in range(args.rounds):
            for threads in args.threads:
                torch.set_num_threads(threads)
                order = modes_here[round_index % len(modes_here):] + modes_here[:round_index % len(modes_here)]
                for mode in order:
                    times[threads, mode].append(timed(runs[mode]) / args.steps)
        tokens = args.batch_size * TOKENS_PER_SAMPLE
        for threads in args.threads:
            entry = {"tokens_per_update": tokens}
            for mode in modes_here:
                median = statistics.median(times[threads, mode])
                entry[f"{mode}_update_s"] = round(median, 3)
                entry[f"{mode}_tokens_per_s"] = round(tokens / median, 1)
                entry[f"{mode}_update_s_rounds"] = [round(t, 3) for t in times[threads, mode]]
            for mode in modes_here[1:]:
                entry[f"{mode}_over_fp32_speed_ratio_of_medians"] = round(
                    statistics.median(times[threads, "fp32"]) / statistics.median(times[threads, mode]), 3)
                entry[f"{mode}_over_fp32_speed_median_of_round_ratios"] = median_ratio(
                    times[threads, "fp32"], times[threads, mode])
            report[f"{model}_threads{threads}"] = entry
        del runs
        gc.collect()
    return report


# ------------------------------------------------------------------ profile

# Kinds of work, by op name. An op inside attention is attention; any other takes the kind of
# the innermost op around it (itself included) that has one: the casts autocast makes inside
# aten::linear count as casts, the elementwise ops inside aten::rms_norm as norms, and an op
# inside none as other. Backward ops go by their own names (a decomposed norm's backward, and
# dropout's, count as other).
KINDS = (
    # Batched multiplies and softmax: SDPA's math backend (these models call them nowhere else).
    ("attention (SDPA)", re.compile(r"scaled_dot_product|ScaledDotProduct|^aten::(bmm|_softmax|_safe_softmax|"
                                    r"_softmax_backward_data)$|^(Bmm|Softmax|SafeSoftmax)Backward")),
    ("matrix multiplies", re.compile(r"^aten::(mm|addmm|bmm|baddbmm|matmul|linear)$|^(Mm|Addmm|Bmm)Backward")),
    ("casts and copies", re.compile(r"^aten::(copy_|_to_copy|to|contiguous|clone)$|ToCopyBackward")),
    ("loss (log-softmax, NLL)", re.compile(r"log_softmax|nll_loss|cross_entropy|LogSoftmaxBackward|NllLossBackward")),
    ("norms", re.compile(r"layer_norm|rms_norm|LayerNormBackward|RmsNormBackward")),
    ("optimizer and clipping", re.compile(r"^Optimizer\.|adamw|_foreach_|linalg_vector_norm")),
)
OTHER = "other (elementwise, embedding, autograd)"


def kind_of(event) -> str:
    kinds = []
    while event is not None:
        kinds += [kind for kind, pattern in KINDS if pattern.search(event.name)][:1]
        event = event.cpu_parent
    return KINDS[0][0] if KINDS[0][0] in kinds else (kinds or [OTHER])[0]


def profiled(run: Callable, rows: int) -> tuple[dict[str, float], str]:
    """Seconds of each kind of work in one ``run`` (self times), and torch.profiler's table of the top ops."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        run()
    kinds = collections.Counter()
    for event in prof.events():
        kinds[kind_of(event)] += event.self_cpu_time_total / 1e6
    table = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=rows, max_name_column_width=60)
    return dict(kinds), table


_LIBC = ctypes.CDLL(None)


@contextlib.contextmanager
def onednn_verbose_into(path: str):
    """oneDNN's verbose lines (written to the process's stdout by C code) into ``path``."""
    with open(path, "w") as sink:
        _LIBC.fflush(None)
        saved = os.dup(1)
        os.dup2(sink.fileno(), 1)
        try:
            with torch.backends.mkldnn.verbose(torch.backends.mkldnn.VERBOSE_ON):
                yield
        finally:
            _LIBC.fflush(None)
            os.dup2(saved, 1)
            os.close(saved)


def onednn_kernels(run: Callable) -> dict:
    """The ISA oneDNN reports (on the first capture of the process only) and, per primitive
    and implementation, how many calls ran and their summed execution time."""
    with tempfile.TemporaryDirectory() as folder:
        path = os.path.join(folder, "onednn.log")
        with onednn_verbose_into(path):
            run()
        lines = open(path).read().splitlines()
    isa = next((line.split("isa:", 1)[1] for line in lines if ",isa:" in line), None)
    calls, ms = collections.Counter(), collections.Counter()
    for line in lines:
        fields = line.split(",")
        if len(fields) > 6 and fields[2] == "primitive" and fields[3] == "exec":
            key = f"{fields[5]} {fields[6]}"  # e.g. "matmul brg_matmul:avx512_core_bf16"
            calls[key] += 1
            ms[key] += float(fields[-1])
    kernels = {key: {"calls": n, "ms": round(ms[key], 1)} for key, n in calls.most_common()}
    return {"isa": isa, "kernels": kernels} if isa else {"kernels": kernels}


def measure_profiles(args, modes: list[str]) -> dict:
    """Per model: each kind of work's seconds in one update per precision and its speed-up
    over fp32, the top ops of each half-precision update, and the oneDNN kernels of each."""
    report = {}
    threads = max(args.threads)
    torch.set_num_threads(threads)
    for model in args.models:
        entry = {"threads": threads}
        kinds = {}
        for mode in contenders_of(model, modes, args.batch_size):
            run = update_runner(build_trainer(model, mode, args.batch_size), 1)
            run()  # warm-up
            entry[f"onednn_{mode}"] = onednn_kernels(run)
            if "isa" in entry[f"onednn_{mode}"]:
                report["onednn_isa"] = entry[f"onednn_{mode}"].pop("isa")
            kinds[mode], table = profiled(run, args.profile_rows)
            if mode != "fp32":
                entry[f"table_{mode}"] = table.splitlines()
            del run
            gc.collect()
        entry["kinds_s"] = {
            kind: {**{mode: round(kinds[mode].get(kind, 0.0), 3) for mode in kinds},
                   **{f"{mode}_speedup": round(kinds["fp32"].get(kind, 0.0) / kinds[mode][kind], 2)
                      for mode in kinds if mode != "fp32" and kinds[mode].get(kind)}}
            for kind in sorted(kinds["bf16"], key=kinds["bf16"].get, reverse=True)
        }
        entry["total_s"] = {mode: round(sum(kinds[mode].values()), 3) for mode in kinds}
        report[model] = entry
    return report


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--parts", default="ceiling,update,profile")
    parser.add_argument("--models", default=",".join(MODELS), help=f"comma-separated, of {', '.join(MODELS)}")
    parser.add_argument("--threads", default=f"1,{torch.get_num_threads()}",
                        help="intra-op thread counts, comma-separated (default: 1 and torch's default)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=1, help="updates per timed round")
    parser.add_argument("--batch-size", type=int, default=4, help=f"samples of {TOKENS_PER_SAMPLE} tokens an update")
    parser.add_argument("--fp16", action="store_true", help="time fp16 too where the CPU has no fp16 instructions")
    parser.add_argument("--profile-rows", type=int, default=25)
    args = parser.parse_args()
    args.threads = sorted({int(t) for t in args.threads.split(",")})
    args.models = args.models.split(",")
    unknown = set(args.models) - set(MODELS)
    if unknown:
        parser.error(f"unknown --models {', '.join(sorted(unknown))}; choose from {', '.join(MODELS)}")
    parts = args.parts.split(",")
    modes = precisions(args.fp16)
    report = {"benchmark": "cpu_precision", **cpu_description(), "batch_size": args.batch_size,
              "tokens_per_sample": TOKENS_PER_SAMPLE, "rounds": args.rounds, "threads": args.threads,
              "precisions": modes}
    started = time.perf_counter()
    if "ceiling" in parts:
        report["ceiling"] = measure_ceiling(args, modes)
    if "update" in parts:
        report["update"] = measure_updates(args, modes)
    if "profile" in parts:
        report["profile"] = measure_profiles(args, modes)
    report["wall_s"] = round(time.perf_counter() - started, 1)
    report["load_average_at_end"] = [round(x, 2) for x in os.getloadavg()]
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
