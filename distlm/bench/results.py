"""From the launches' raw timings to one row per point: medians, the step-time split,
tokens/s, efficiency, MFU and memory; and the files a run leaves (results.jsonl,
allreduce.jsonl, calibration.jsonl, results.md).

A point is one strategy at one world size. Each launch gives, per point, the median over
its timed updates of the update time, of the optimizer part, and of the update with
communication off less its optimizer part (the compute). A point's values are the
medians of those over the repetitions, and

    comm_exposed_s = step_time_s - compute_s - optimizer_s

holds exactly. With one data-parallel replica nothing communicates: compute_s is
step_time_s - optimizer_s and comm_exposed_s is 0.

A point is ``under_load`` when a 1-minute load average read around one of its launches
exceeded the cores the suite's ranks use: other work shared them, and its times, its
efficiency (and that of the points measured against it) and its planner miss are noise;
results.md marks them so.
"""

from __future__ import annotations

import json
import statistics
from pathlib import Path
from typing import Any, Iterable

from distlm.choices import COLLECTIVE_OF_PROBE_METHOD, PROBE_METHODS
from distlm.errors import UsageError
from distlm.layout import Layout, PipelineLayout
from distlm.models.flops import model_flops_utilization, model_shape
from distlm.plan.calibrate import calibrate, read_measurements
from distlm.plan.model import Placement, Workload, executed_flops_per_token, load_cluster, project
from distlm.precision import dtype_name

# Rows with the same values of these fields are one scaling series; its efficiency is
# measured against its smallest world size. Weak scaling keeps the per-replica batch,
# strong scaling the global batch.
SERIES_FIELDS = ("arch", "mode", "strategy", "tokens_per_sample", "update_freq", "precision", "comm_hook",
                 "tp_degree", "pp_degree", "pp_schedule", "pp_microbatches", "pp_stages_per_rank", "vocab_size",
                 "device", "threads_per_rank")
# Fields rows written before they existed lack: their value then.
FIELD_DEFAULTS = {"pp_degree": Layout.pp_degree, "pp_schedule": None, "pp_microbatches": None,
                  "pp_stages_per_rank": None}
# Model-parallel settings: a series with them compares with the same settings without.
MODEL_PARALLEL_FIELDS = ("tp_degree", "pp_degree", "pp_schedule", "pp_microbatches", "pp_stages_per_rank")
RESULTS, ALLREDUCE, CALIBRATION, TABLE = "results.jsonl", "allreduce.jsonl", "calibration.jsonl", "results.md"


def series_key(row: dict[str, Any]) -> tuple:
    """What a row's scaling series is: its settings but the world size."""
    batch = row["batch_size"] if row["mode"] == "weak" else row["global_batch_size"]
    return tuple(row.get(name, FIELD_DEFAULTS.get(name)) if name in FIELD_DEFAULTS else row[name]
                 for name in SERIES_FIELDS) + (batch,)


def point_key(row: dict[str, Any]) -> tuple:
    """What a row measures: its series and world size."""
    return series_key(row) + (row["world_size"],)


def series_label(row: dict[str, Any]) -> str:
    """The strategy, with its comm hook, tp and pp degree where not the defaults (``ddp fp16``, ``fsdp tp2``)."""
    return (row["strategy"] + ("" if row["comm_hook"] == "allreduce" else f" {row['comm_hook']}")
            + ("" if row["tp_degree"] == 1 else f" tp{row['tp_degree']}")
            + ("" if row.get("pp_degree", 1) == 1 else f" pp{row['pp_degree']}")
            + ("" if row.get("pp_schedule") in (None, PipelineLayout.schedule) else f" {row['pp_schedule']}"))


def launch_under_load(launch: dict[str, Any]) -> bool:
    """Whether a load average read around ``launch`` exceeded the cores the suite's ranks use."""
    cores = launch.get("load_cores")
    return cores is not None and any(load is not None and load > cores for load in launch.get("load_average") or ())


def launch_summary(times: dict[str, Any]) -> dict[str, float | None]:
    """Medians over one launch's timed updates of one strategy."""
    compute = None
    if times["compute_step_s"]:
        compute = statistics.median(
            step - optimizer for step, optimizer in zip(times["compute_step_s"], times["compute_optimizer_s"])
        )
    return {
        "step": statistics.median(times["step_s"]),
        "optimizer": statistics.median(times["optimizer_s"]),
        "compute": compute,
    }


def point_rows(launches: list[dict[str, Any]], settings: dict[str, Any]) -> list[dict[str, Any]]:
    """One row per (strategy, comm hook, tp degree, pp degree, world size) from the launches' raw
    results (``worker`` output).

    ``settings`` holds ``arch``, ``mode``, the requested ``strategies`` and, optionally, the
    ``combinations`` ([strategy, comm hook, tp degree (, pp degree)]) the sweep runs; everything else
    comes from each launch's spec. A launch with one data-parallel replica stands for
    every combination of its tp and pp degree: nothing communicates gradients, wraps or shards there.
    """
    combos = [list(c) + [1] * (4 - len(c)) for c in settings.get("combinations") or []]  # pp 1 unless given
    samples: dict[tuple[str, str, int, int, int], list[dict[str, Any]]] = {}
    for launch in launches:
        layout = Layout.from_settings(launch["spec"])  # a spec of before pipelines holds no pp_* keys
        degrees = (layout.tp_degree, layout.pp_degree)
        for times in launch["strategies"]:
            point = (times["strategy"], layout.comm_hook, *degrees)
            if times["dp_degree"] == 1:
                stands_for = [tuple(c) for c in combos if tuple(c[2:]) == degrees] if combos else [
                    (strategy, layout.comm_hook, *degrees) for strategy in settings["strategies"]]
            else:
                stands_for = [point]
            for strategy, comm_hook, tp_degree, pp_degree in stands_for:
                samples.setdefault((strategy, comm_hook, tp_degree, pp_degree, times["world_size"]), []).append(
                    {"launch": launch, "times": times}
                )

    rows = []
    for (strategy, comm_hook, _, _, world_size), entries in sorted(samples.items()):
        summaries = [launch_summary(entry["times"]) for entry in entries]
        step = statistics.median(s["step"] for s in summaries)
        optimizer = statistics.median(s["optimizer"] for s in summaries)
        if any(s["compute"] is None for s in summaries):
            compute = step - optimizer
        else:
            compute = statistics.median(s["compute"] for s in summaries)
        last = entries[-1]
        times, spec, launch = last["times"], last["launch"]["spec"], last["launch"]
        global_batch = spec["batch_size"] * spec["update_freq"] * times["dp_degree"]
        tokens_per_s = global_batch * spec["tokens_per_sample"] / step
        memory = max(times["memory"], key=lambda report: report.get("total_bytes", 0))
        peaks = [e["launch"]["peak_flops_per_rank"] for e in entries if e["launch"]["peak_flops_per_rank"]]
        peak = statistics.median(peaks) if peaks else None
        per_token = executed_flops_per_token(model_shape(settings["arch"], times["vocab_size"]), spec["tokens_per_sample"])
        overheads = [
            statistics.median(e["times"]["optimizer_dtensor_s"]) - statistics.median(e["times"]["optimizer_plain_s"])
            for e in entries if e["times"].get("optimizer_dtensor_s")
        ]
        layout = Layout.from_settings(spec)
        pp_degree, pipeline = layout.pp_degree, layout.pipeline
        pipelined = pp_degree > 1
        loads = [load for e in entries for load in e["launch"].get("load_average") or () if load is not None]
        rows.append({
            "world_size": world_size,
            "strategy": strategy,
            "mode": settings["mode"],
            "arch": settings["arch"],
            "vocab_size": times["vocab_size"],
            "tokens_per_sample": spec["tokens_per_sample"],
            "batch_size": spec["batch_size"],
            "update_freq": spec["update_freq"],
            "global_batch_size": global_batch,
            "dp_degree": times["dp_degree"],
            "tp_degree": layout.tp_degree,
            "pp_degree": pp_degree,
            "pp_schedule": pipeline.schedule if pipelined else None,
            "pp_microbatches": pipeline.microbatch_count(pp_degree) if pipelined else None,
            "pp_stages_per_rank": pipeline.stages_per_rank if pipelined else None,
            "precision": spec["precision"],
            "comm_hook": comm_hook,
            "device": launch["device"],
            "threads_per_rank": launch["threads_per_rank"],
            "host_cores": launch.get("host_cores"),
            "steps": spec["steps"],
            "warmup_steps": spec["warmup_steps"],
            "repeats": len(entries),
            "step_time_s": step,
            "compute_s": compute,
            "comm_exposed_s": step - compute - optimizer,
            "optimizer_s": optimizer,
            "dtensor_optimizer_overhead_s": statistics.median(overheads) if overheads else None,
            "tokens_per_s": tokens_per_s,
            "samples_per_s": global_batch / step,
            "efficiency": None,
            "efficiency_baseline_world_size": None,
            "mfu": model_flops_utilization(tokens_per_s, per_token, peak, world_size) if peak else None,
            "flops_per_token": per_token,
            "peak_flops_per_rank": peak,
            "memory_bytes_per_rank": memory.get("total_bytes"),
            "param_bytes": memory.get("param_bytes"),
            "grad_bytes": memory.get("grad_bytes"),
            "optimizer_bytes": memory.get("optimizer_bytes"),
            "predicted_step_time_s": None,
            "step_time_s_repeats": [s["step"] for s in summaries],
            "load_average_max": max(loads) if loads else None,
            "load_cores": launch.get("load_cores"),
            "under_load": any(launch_under_load(e["launch"]) for e in entries),
            "torch": launch["torch"],
        })
    return with_efficiency(rows)


def predict_step_times(rows: list[dict[str, Any]], calibration: Path, bucket_cap_mb: float) -> list[str]:
    """Fill each row's ``predicted_step_time_s``: the planner's projection of the point on
    this machine (its ``local`` profile, every rank on this host), calibrated from
    ``calibration`` (calibration.jsonl) as ``python -m distlm.plan --cluster local
    --calibrate`` calibrates it. That file holds no update of more than one rank, so no
    multi-rank point is predicted from its own measurement.

    A row stays null off CPU (the profile is of this CPU host) and without a one-rank row of
    its precision: compute would then rest on the profile's assumed fraction of peak, not
    on a measurement. Returns a line for each point the planner refuses, and for a
    calibration file it cannot fit, rather than losing the sweep's results to either."""
    if not any(row["world_size"] == 1 for row in rows):
        return []
    try:
        calibration_fit = calibrate(read_measurements(calibration))
    except UsageError as exc:
        return [f"no predicted step times: {exc}"]
    host = max(row["world_size"] for row in rows)
    cluster = calibration_fit.apply(load_cluster("local", ranks_per_node=host))
    refused = []
    for row in rows:
        if row["device"] != "cpu" or dtype_name(row["precision"]) not in calibration_fit.achieved_flops:
            continue
        # A row holds the layout's settings under distlm.train's names; null pipeline ones (pp 1) take the defaults.
        layout = Layout.from_settings({name: value for name, value in row.items() if value is not None}
                                      | {"bucket_cap_mb": bucket_cap_mb})
        workload = Workload(
            shape=model_shape(row["arch"], row["vocab_size"]), layout=layout, precision=row["precision"],
            tokens_per_sample=row["tokens_per_sample"], batch_size=row["batch_size"], update_freq=row["update_freq"],
        )
        try:
            placement = Placement(nodes=1, ranks_per_node=row["world_size"], layout=layout)
            row["predicted_step_time_s"] = project(workload, cluster, placement).step_time_s
        except UsageError as exc:
            refused.append(f"no predicted step time for {series_label(row)} at {row['world_size']} ranks: {exc}")
    return refused


def baseline_key(row: dict[str, Any]) -> tuple:
    """A row's series but its tp and pp degrees: model-parallel series compare with the plain one."""
    return tuple(value for name, value in zip(SERIES_FIELDS, series_key(row)) if name not in MODEL_PARALLEL_FIELDS) + (
        series_key(row)[-1],
    )


def with_efficiency(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Fill ``efficiency``: tokens/s per rank over that of the baseline, the smallest world
    size of the series, or for a tensor- or pipeline-parallel series that of the same settings
    without them (its 1-rank point) when the sweep has it.

    Weak scaling: per-rank throughput relative to the baseline. Strong scaling (same
    tokens per update): speedup over the baseline divided by the growth in ranks. Both are
    ``(tokens_per_s / world_size) / (baseline tokens_per_s / baseline world_size)``.
    """
    baselines = efficiency_baselines(rows)
    for row in rows:
        base = baselines[series_key(row)]
        row["efficiency"] = (row["tokens_per_s"] / row["world_size"]) / (base["tokens_per_s"] / base["world_size"])
        row["efficiency_baseline_world_size"] = base["world_size"]
    return rows


def efficiency_baselines(rows: list[dict[str, Any]]) -> dict[tuple, dict[str, Any]]:
    """Each series' (``series_key``) baseline row, as ``with_efficiency`` describes."""
    baselines: dict[tuple, dict[str, Any]] = {}
    for row in rows:
        key = series_key(row)
        if key not in baselines or row["world_size"] < baselines[key]["world_size"]:
            baselines[key] = row
    def model_parallel(row: dict[str, Any]) -> bool:
        return row["tp_degree"] > 1 or row.get("pp_degree", 1) > 1

    plain = {baseline_key(base): base for base in baselines.values() if not model_parallel(base)}
    for key, base in list(baselines.items()):
        if model_parallel(base) and baseline_key(base) in plain:
            baselines[key] = plain[baseline_key(base)]
    return baselines


def load_note(rows: list[dict[str, Any]]) -> str | None:
    """A sentence on the points measured under load, or None when there are none."""
    loaded = [row for row in rows if row.get("under_load")]
    if not loaded:
        return None
    highest = max(row["load_average_max"] for row in loaded)
    return (f"{len(loaded)} of {len(rows)} points were measured under load (1-minute load average up to "
            f"{highest:.2f}, above the {loaded[0]['load_cores']} cores the suite's ranks use): other work shared "
            "the cores, so their times, their efficiency and that of the points measured against them, and their "
            "planner miss are noise, not distlm's scaling (marked * in results.md); rerun them on an idle machine")


def bus_factor(method: str, ranks: int) -> float:
    """Bus bandwidth over algorithm bandwidth of a probe method (nccl-tests' definitions):
    an all-reduce moves its buffer twice, all-gather and reduce-scatter once."""
    moves = 2 if COLLECTIVE_OF_PROBE_METHOD[method] == "all_reduce" else 1
    return moves * (ranks - 1) / ranks


def allreduce_reports(launches: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One collective-probe report per layout: per collective and size, the median over
    the launches' medians."""
    grouped: dict[tuple[int, int], list[dict[str, Any]]] = {}
    for launch in launches:
        report = launch.get("allreduce")
        if report:
            grouped.setdefault((report["world_size"], report["ranks_per_node"]), []).append(report)
    reports = []
    for (world_size, per_node), group in sorted(grouped.items()):
        by_point: dict[tuple[str, int], list[float]] = {}
        for report in group:
            for row in report["collectives"]:
                by_point.setdefault((row["method"], row["size_bytes"]), []).append(row["median_s"])
        order = {method: index for index, method in enumerate(PROBE_METHODS.values())}
        reports.append({
            "benchmark": "allreduce",
            "world_size": world_size,
            "ranks_per_node": per_node,
            "torch": group[-1]["torch"],
            "repeats": len(group),
            "collectives": [
                {"size_bytes": size, "method": method, "median_s": statistics.median(values),
                 "busbw_GBps": size / statistics.median(values) / 1e9 * bus_factor(method, world_size)}
                for (method, size), values in sorted(by_point.items(), key=lambda item: (order[item[0][0]], item[0][1]))
            ],
        })
    return reports


def expected_slowest(samples: list[float], count: int) -> float:
    """The expected largest of ``count`` independent draws from ``samples``' distribution:
    over the sorted samples x_1..x_m, the sum of x_i ((i/m)^count - ((i-1)/m)^count)."""
    ordered = sorted(samples)
    m = len(ordered)
    return sum(x * ((i / m) ** count - ((i - 1) / m) ** count) for i, x in enumerate(ordered, 1))


def host_sharing_rows(launches: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One object per count of concurrent one-rank launches (``scaling.run_concurrent``):
    the medians over repetitions of their mean compute, expected slowest compute and mean
    optimizer seconds."""
    grouped: dict[int, list[dict[str, Any]]] = {}
    for launch in launches:
        grouped.setdefault(launch["concurrent_processes"], []).append(launch)
    rows = []
    for processes, group in sorted(grouped.items()):
        spec = group[-1]["spec"]
        rows.append({
            "benchmark": "host_sharing",
            "processes": processes,
            "arch": spec["arch"],
            "vocab_size": group[-1]["vocab_size"],
            "tokens_per_sample": spec["tokens_per_sample"],
            "batch_size": spec["batch_size"],
            "update_freq": spec["update_freq"],
            "precision": spec["precision"],
            "threads_per_rank": group[-1]["threads_per_rank"],
            "device": group[-1]["device"],
            "repeats": len(group),
            "compute_s": statistics.median(launch["compute_s"] for launch in group),
            "slowest_compute_s": statistics.median(launch["slowest_compute_s"] for launch in group),
            "optimizer_s": statistics.median(launch["optimizer_s"] for launch in group),
        })
    return rows


def calibration_objects(
    rows: list[dict[str, Any]], reports: list[dict[str, Any]], sharing: list[dict[str, Any]] = ()
) -> list[dict[str, Any]]:
    """What ``distlm.plan --calibrate`` should fit to: the one-rank rows (achieved FLOP/s,
    optimizer bandwidth, threads and cores), the same one-rank update run N times at once
    (what sharing the host costs compute and optimizer, ``host_sharing_rows``) and every
    layout's collective probe (each collective alone, so each layout's alpha and beta). No
    update measured at more than one rank, which is what the planner is asked to predict."""
    return [row for row in rows if row["world_size"] == 1] + list(sharing) + list(reports)


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    """The objects of a JSON-lines file; none if it does not exist."""
    if not path.is_file():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def write_jsonl(path: Path, objects: Iterable[dict[str, Any]]) -> None:
    """One JSON object per line, floats to 6 significant digits, replaced atomically."""
    partial = path.with_name(path.name + ".partial")
    partial.write_text("".join(json.dumps(_rounded(obj)) + "\n" for obj in objects))
    partial.replace(path)


def merge_rows(old: list[dict[str, Any]], new: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """``old`` rows with the points of ``new`` replaced or added, efficiency recomputed."""
    fresh = {point_key(row) for row in new}
    merged = [row for row in old if point_key(row) not in fresh] + new
    return with_efficiency(sorted(merged, key=lambda row: (series_key(row), row["world_size"])))


def merge_reports(old: list[dict[str, Any]], new: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """``old`` all-reduce reports with those of ``new``'s layouts replaced or added."""
    layout = lambda report: (report["world_size"], report["ranks_per_node"])  # noqa: E731
    fresh = {layout(report) for report in new}
    return sorted([r for r in old if layout(r) not in fresh] + new, key=layout)


def _rounded(value: Any) -> Any:
    if isinstance(value, float):
        return float(f"{value:.6g}")
    if isinstance(value, dict):
        return {key: _rounded(item) for key, item in value.items()}
    if isinstance(value, list):
        return [_rounded(item) for item in value]
    return value


def markdown_table(rows: list[dict[str, Any]]) -> str:
    """results.md: the points as a Markdown table, with what the columns mean."""
    lines = ["# Scaling results", ""]
    settings = []
    for row in rows:
        line = (
            f"- {row['arch']} ({row['vocab_size']}-symbol vocabulary), {row['mode']} scaling, "
            f"{row['tokens_per_sample']} tokens per sample, {row['precision']}, update-freq {row['update_freq']}, "
            f"tp {row['tp_degree']}, comm hook {row['comm_hook']}, {row['device']} with "
            f"{row['threads_per_rank']} thread(s) per rank; medians of {row['repeats']} repetition(s) "
            f"of {row['steps']} timed updates"
        )
        if line not in settings:
            settings.append(line)
    lines += settings
    lines += [
        "",
        "| ranks | strategy | batch per replica | global batch | step (s) | compute (s) | exposed comm (s) "
        "| optimizer (s) | predicted step (s) | tokens/s | efficiency | MFU | memory per rank (MiB) |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    baselines = efficiency_baselines(rows)
    # The planner's compute and optimizer come from the one-rank rows (calibration.jsonl).
    calibration_loaded = any(row.get("under_load") for row in rows if row["world_size"] == 1)
    for row in sorted(rows, key=lambda r: (r["mode"], series_label(r), r["world_size"])):
        loaded = "*" if row.get("under_load") else ""
        base_loaded = "*" if loaded or baselines[series_key(row)].get("under_load") else ""
        mfu = f"{row['mfu']:.3f}{loaded}" if row["mfu"] is not None else "n/a"
        memory = f"{row['memory_bytes_per_rank'] / 2**20:.1f}" if row["memory_bytes_per_rank"] else "n/a"
        predicted = row.get("predicted_step_time_s")
        predicted = "n/a" if predicted is None else (f"{predicted:.4f} ({predicted / row['step_time_s'] - 1:+.0%})"
                                                     + ("*" if loaded or calibration_loaded else ""))
        lines.append(
            f"| {row['world_size']} | {series_label(row)} | {row['batch_size']} x {row['update_freq']} "
            f"| {row['global_batch_size']} | {row['step_time_s']:.4f}{loaded} | {row['compute_s']:.4f}{loaded} "
            f"| {row['comm_exposed_s']:.4f}{loaded} | {row['optimizer_s']:.4f}{loaded} | {predicted} "
            f"| {row['tokens_per_s']:.0f}{loaded} | {row['efficiency']:.3f}{base_loaded} | {mfu} | {memory} |"
        )
    lines += [
        "",
        "step: median update time. compute: the same updates with data-parallel communication off, less their "
        "optimizer part. exposed comm = step - compute - optimizer: the communication that compute did not hide "
        "(noise can make it slightly negative). optimizer: gradient unscale and clipping plus the optimizer step. "
        "predicted step: the planner (distlm.plan, this machine's profile) calibrated from calibration.jsonl, "
        "which holds no multi-rank update, and how far it is from the measured step. "
        "efficiency: tokens/s per rank over that of the smallest world size of the series (a tensor-parallel "
        "series: over the 1-rank point of its strategy). "
        "memory: parameters, gradients and optimizer state of the rank holding the most.",
        "",
    ]
    note = load_note(rows)
    if note:
        lines += [f"**Noise.** {note[0].upper()}{note[1:]}. A step, tokens/s or MFU marked * is of such a point, "
                  "an efficiency marked * is against one (or of one), and a prediction marked * compares with one "
                  "or was calibrated from a one-rank point that was.", ""]
    return "\n".join(lines)
