"""Project step time, tokens/s, scaling efficiency and memory per rank of a training run.

    python -m distlm.plan --arch llama3_8b --cluster trn1.32xlarge --nodes 1,2,4,8 \\
        --strategy zero1 --tp-degree 32 --precision bf16 --tokens-per-sample 8192 \\
        --batch-size 1 --global-batch-size 1024
    python -m distlm.plan --arch path/to/Llama-3.1-70B/config.json --cluster trn1.32xlarge --nodes 32 \\
        --tp-degree 32 --pp-degree 8 --pp-microbatches 32 --batch-size 32 --precision bf16 ...

One row per node count (``--json``: a JSON list of objects). Flags keep distlm.train's
names, meanings and defaults. ``--cluster local --ranks 1,2 --calibrate FILE`` plans this
machine from measurements.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Sequence

from distlm.choices import COMM_HOOKS, PP_SCHEDULES, STRATEGIES
from distlm.config import check_shared_settings
from distlm.errors import OneLineErrorParser, UsageError, whole_number_list
from distlm.layout import Layout, PipelineLayout
from distlm.models.flops import count_parameters, flops_per_token, model_shape
from distlm.plan.calibrate import calibrate, read_measurements
from distlm.plan.model import (
    ALLREDUCE_ALGORITHMS,
    GIB,
    Projection,
    Workload,
    available_clusters,
    load_cluster,
    placements,
    project,
    resolve_batch,
)
from distlm.precision import DTYPES


def build_parser() -> OneLineErrorParser:
    parser = OneLineErrorParser(
        prog="python -m distlm.plan", allow_abbrev=False, description=__doc__.splitlines()[0]
    )
    add = parser.add_argument
    add("--arch", required=True,
        help="a distlm arch name or a Hugging Face config.json (model_type llama, roberta, qwen3_moe or mixtral)")
    add("--cluster", required=True, help=f"one of {', '.join(available_clusters())}, or a profile .toml file")
    add("--nodes", type=whole_number_list("--nodes"), default=None, help="node counts to project, e.g. 1,2,4 (default 1)")
    add("--ranks", type=whole_number_list("--ranks"), default=None,
        help="total rank counts instead of --nodes; fewer than a node's ranks use part of one node")
    add("--ranks-per-node", type=int, default=None, help="override the profile's ranks per node")
    add("--strategy", default=Layout.strategy, choices=STRATEGIES, help="ddp, zero1 or fsdp")
    add("--tp-degree", type=int, default=Layout.tp_degree, help="tensor-parallel degree (inside a node)")
    add("--pp-degree", type=int, default=Layout.pp_degree, help="pipeline stages (outermost: pp x dp x tp ranks)")
    add("--ep-degree", type=int, default=Layout.ep_degree,
        help="expert parallel: consecutive data-parallel ranks that split each MoE layer's experts")
    add("--pp-schedule", default=PipelineLayout.schedule, choices=PP_SCHEDULES,
        help=f"pipeline schedule (default {PipelineLayout.schedule})")
    add("--pp-microbatches", type=int, default=PipelineLayout.microbatches,
        help="micro-batches each --batch-size is split into per pipeline pass (default 0: 2 x --pp-degree)")
    add("--pp-stages-per-rank", type=int, default=PipelineLayout.stages_per_rank,
        help=f"stages per rank (default {PipelineLayout.stages_per_rank}; the looped schedules interleaved-1f1b and "
             "zero-bubble run 2 or more, zbv exactly 2)")
    add("--batch-size", type=int, default=None, help="samples per micro-batch per data-parallel replica (default 16)")
    add("--update-freq", type=int, default=None, help="micro-batches per update (default 1)")
    add("--global-batch-size", type=int, default=None,
        help="samples per update over all replicas (strong scaling); split over the replicas of each layout")
    add("--tokens-per-sample", type=int, default=128, help="sequence length")
    add("--vocab-size", type=int, default=None,
        help="vocabulary size (default: the config's, or the arch namesake's published one)")
    add("--precision", default="fp32", choices=DTYPES, help="compute precision (fp16/bf16: autocast, fp32 weights)")
    add("--comm-hook", default=Layout.comm_hook, choices=COMM_HOOKS,
        help="gradient all-reduce algorithm of DDP's buckets")
    add("--double-buffering", action="store_true", help="ChainerMN double buffering (one-step-stale gradients)")
    add("--bucket-cap-mb", type=float, default=Layout.bucket_cap_mb, help="DDP gradient bucket size in MiB")
    add("--allreduce-algorithm", default="ring", choices=ALLREDUCE_ALGORITHMS,
        help="flat all-reduce: ring, tree, or auto (the faster per message, as NCCL picks)")
    add("--sequence-parallel", action="store_true", help="with --tp-degree: shard activations along the sequence")
    add("--activation-checkpointing", action="store_true", help="recompute each block's forward in backward")
    add("--calibrate", default=None, metavar="FILE",
        help="fit the link and achieved FLOP/s to benchmarks/allreduce.py output and scaling-suite JSONL rows")
    add("--json", action="store_true", help="print a JSON list of row objects")
    return parser


def plan(args: argparse.Namespace) -> tuple[list[Projection], list[str]]:
    """Project the parsed command line: ``(rows, header lines)``."""
    cluster = load_cluster(args.cluster, args.ranks_per_node)
    if cluster.single_host and args.ranks and args.ranks_per_node is None:
        # This machine: --ranks N are N ranks on it, one node however many there are;
        # loaded for that many, so the threads per rank (cores over ranks) follow too.
        cluster = load_cluster(args.cluster, max(args.ranks))
    notes: list[str] = []
    if args.calibrate is not None:
        calibration = calibrate(read_measurements(args.calibrate), args.vocab_size)
        cluster = calibration.apply(cluster)
        notes += [f"calibrated: {note}" for note in calibration.notes]
    if cluster.device_type == "cpu" and cluster.cores_per_node:
        notes.append(
            f"{cluster.cores_per_node} cores per {'host' if cluster.single_host else 'node'}, "
            f"{cluster.cpu_threads_per_rank or 1} thread(s) per rank: more ranks x threads than cores slow every "
            "rank down by their ratio (or as measured with that many one-rank updates at once), collectives "
            "overlap compute only while a core is idle, and one issued while its rank computes shares its cores"
        )
    shape = model_shape(args.arch, args.vocab_size)
    # The flags keep distlm.train's names, but --ranks-per-node: here the cluster's, not simulated nodes.
    layout = Layout.from_settings({name: value for name, value in vars(args).items() if name != "ranks_per_node"})
    rows = []
    for placement in placements(cluster, args.nodes, args.ranks, layout):
        micro, update_freq = resolve_batch(placement.dp, args.batch_size, args.update_freq, args.global_batch_size)
        workload = Workload(
            shape=shape, layout=layout, precision=args.precision, tokens_per_sample=args.tokens_per_sample,
            batch_size=micro, update_freq=update_freq, allreduce_algorithm=args.allreduce_algorithm,
        )
        rows.append(project(workload, cluster, placement))
    header = [
        f"{args.arch}: {count_parameters(shape) / 1e9:.3f} B parameters (vocabulary {shape.vocab_size}), "
        f"{flops_per_token(shape, args.tokens_per_sample) / 1e9:.3f} GFLOP per token "
        f"at {args.tokens_per_sample} tokens",
        f"{cluster.name} ({cluster.device}, {cluster.ranks_per_node} ranks/node, "
        f"{cluster.achieved_flops_per_rank(args.precision) / 1e12:.2f} TFLOP/s achieved per rank in {args.precision}), "
        f"--strategy {args.strategy}, --tp-degree {args.tp_degree}, --comm-hook {args.comm_hook}"
        + (" with double buffering" if args.double_buffering else "")
        + f" ({args.allreduce_algorithm}), buckets of {args.bucket_cap_mb:g} MiB",
    ] + notes
    if rows and rows[0].pp_degree > 1:
        row = rows[0]
        header.append(
            f"--pp-degree {row.pp_degree}, --pp-schedule {row.pp_schedule}, {row.pp_microbatches} micro-batches "
            f"per pass, {row.pp_stages_per_rank} stage(s) per rank: bubble {row.pp_bubble_s:.3f} s of the first row's "
            f"{row.step_time_s:.3f} s step"
        )
    if shape.n_experts:
        row = rows[0] if rows else None
        header.append(
            f"mixture of experts: {shape.n_moe_layers} MoE layers of {shape.n_experts} experts, top-{shape.top_k}; "
            f"{(count_parameters(shape) - shape.inactive_expert_parameters) / 1e9:.3f} B parameters active per token"
            + (f"; --ep-degree {row.ep_degree}: {row.expert_bytes_per_rank / GIB:.2f} GiB of experts per rank, "
               f"{row.all_to_all_bytes / GIB:.2f} GiB sent by all-to-alls per rank per update"
               if row is not None and row.ep_degree > 1 else "")
        )
    if args.tp_degree > shape.n_kv_heads:
        header.append(
            f"note: --tp-degree {args.tp_degree} > n_kv_heads {shape.n_kv_heads}: each rank keeps one key/value head, "
            f"replicated over {args.tp_degree // shape.n_kv_heads} ranks (distlm's, Megatron's and "
            "neuronx-distributed's layout)"
        )
    return rows, header


def format_table(rows: list[Projection]) -> str:
    columns = [
        ("nodes", "{:>5}", lambda r: r.nodes),
        ("ranks", "{:>5}", lambda r: r.ranks),
        ("dp", "{:>4}", lambda r: r.dp_degree),
        ("batch", "{:>6}", lambda r: f"{r.global_batch_size // (r.dp_degree * r.update_freq)}x{r.update_freq}"),
        ("step_s", "{:>8.3f}", lambda r: r.step_time_s),
        ("compute", "{:>8.3f}", lambda r: r.compute_s),
        ("tp_comm", "{:>8.3f}", lambda r: r.tp_comm_s),
        ("dp_comm", "{:>8.3f}", lambda r: r.dp_comm_s),
        ("exposed", "{:>8.3f}", lambda r: r.comm_exposed_s),
        *([("bubble", "{:>8.3f}", lambda r: r.pp_bubble_s), ("p2p", "{:>7.3f}", lambda r: r.pp_p2p_s)]
          if any(r.pp_degree > 1 for r in rows) else []),
        *([("moe_comm", "{:>8.3f}", lambda r: r.moe_comm_s)] if any(r.moe_comm_s for r in rows) else []),
        ("optim", "{:>7.3f}", lambda r: r.optimizer_s),
        ("tokens/s", "{:>10.0f}", lambda r: r.tokens_per_s),
        ("samples/s", "{:>9.2f}", lambda r: r.samples_per_s),
        ("eff", "{:>5.2f}", lambda r: r.efficiency),
        ("mfu", "{:>5.2f}", lambda r: r.mfu),
        ("GiB/rank", "{:>8.2f}", lambda r: r.memory_bytes_per_rank / GIB),
        ("+act", "{:>7.2f}", lambda r: r.activation_bytes_per_rank / GIB),
        ("fits", "{:>4}", lambda r: "yes" if r.fits else "NO"),
    ]
    widths = [len(fmt.format(getter(rows[0]))) if rows else len(name) for name, fmt, getter in columns]
    lines = ["  ".join(name.rjust(max(width, len(name))) for (name, _, _), width in zip(columns, widths))]
    for row in rows:
        lines.append("  ".join(
            fmt.format(getter(row)).rjust(max(width, len(name)))
            for (name, fmt, getter), width in zip(columns, widths)
        ))
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    try:
        args = build_parser().parse_args(argv)
        # Flags named as distlm.train's mean what they mean there, within the same bounds.
        check_shared_settings(vars(args))
        rows, header = plan(args)
    except UsageError as exc:
        print(f"distlm.plan: error: {exc}", file=sys.stderr)
        return UsageError.exit_code
    if args.json:
        for line in header:
            print(line, file=sys.stderr)
        print(json.dumps([row.to_dict() for row in rows], indent=1))
    else:
        print("\n".join(header))
        print(format_table(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
