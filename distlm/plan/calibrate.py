"""Fit the planner's alpha, beta and achieved FLOP/s to measurements.

Two kinds of JSON objects are read from one file, in any order, one per line or pretty
printed one after another:

* the report ``benchmarks/allreduce.py`` prints (``"benchmark": "allreduce"``): its flat
  all-reduce points (``collectives`` rows of method ``plain``) give the link;
* rows of the scaling suite (``world_size``, ``strategy``, ``tokens_per_s``, ``step_time_s``,
  ``compute_s``, ``comm_exposed_s``, ``optimizer_s``, ``memory_bytes_per_rank``, ``mfu``,
  ``efficiency``, ``arch``, ``batch_size``, ``tokens_per_sample``, ``precision``): their
  one-rank rows give the achieved FLOP/s (the FLOPs the step runs over its compute time)
  and the optimizer's memory bandwidth.

The link fit is least squares of ``time = alpha_total + bytes x beta_total`` in relative
error (every size weighs alike, from 64 KiB to 256 MiB), then read through the ring
all-reduce formula ``2 (p-1) alpha + 2 (p-1)/p x n / bandwidth`` as a per-step latency and
a bus bandwidth.
"""

from __future__ import annotations

import dataclasses
import json
import statistics
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from distlm.errors import UsageError
from distlm.plan.flops import count_parameters, dtype_name, model_shape
from distlm.plan.model import ADAM_BYTES_PER_PARAM, Cluster, Link, executed_flops_per_token

SCALING_FIELDS = ("world_size", "strategy", "tokens_per_s", "step_time_s", "compute_s")


@dataclass(frozen=True)
class CollectivePoint:
    """One timed all-reduce: ``nbytes`` over ``ranks`` ranks (``ranks_per_node`` per node) in ``seconds``."""

    nbytes: float
    seconds: float
    ranks: int
    ranks_per_node: int


@dataclass
class Measurements:
    collectives: list[CollectivePoint] = field(default_factory=list)
    scaling_rows: list[dict[str, Any]] = field(default_factory=list)


@dataclass
class Calibration:
    """What the measurements fixed; ``None`` where they said nothing."""

    intra: Link | None = None
    inter: Link | None = None
    achieved_flops: dict[str, float] = field(default_factory=dict)
    memory_bandwidth_Bps: float | None = None
    notes: list[str] = field(default_factory=list)

    def apply(self, cluster: Cluster) -> Cluster:
        """``cluster`` with the calibrated numbers in place of its profile's."""
        return dataclasses.replace(
            cluster,
            intra=self.intra or cluster.intra,
            inter=self.inter or cluster.inter,
            achieved_flops={**cluster.achieved_flops, **self.achieved_flops},
            memory_bandwidth_Bps=self.memory_bandwidth_Bps or cluster.memory_bandwidth_Bps,
        )


def read_measurements(path: str | Path) -> Measurements:
    """All-reduce reports and scaling-suite rows from ``path`` (JSON objects, one after another)."""
    path = Path(path)
    try:
        text = path.read_text()
    except OSError as exc:
        raise UsageError(f"--calibrate {path}: cannot read it ({exc.strerror or exc})") from None
    decoder = json.JSONDecoder()
    measurements = Measurements()
    position, count = 0, 0
    while True:
        while position < len(text) and text[position].isspace():
            position += 1
        if position == len(text):
            break
        try:
            obj, position = decoder.raw_decode(text, position)
        except json.JSONDecodeError as exc:
            raise UsageError(f"--calibrate {path}: not JSON at line {exc.lineno} ({exc.msg})") from None
        count += 1
        _add_object(obj, measurements, f"--calibrate {path}: object {count}")
    if not measurements.collectives and not measurements.scaling_rows:
        raise UsageError(
            f"--calibrate {path}: no all-reduce report (benchmarks/allreduce.py) and no scaling-suite rows in it"
        )
    return measurements


def _add_object(obj: Any, measurements: Measurements, where: str) -> None:
    if isinstance(obj, dict) and obj.get("benchmark") == "allreduce":
        world, per_node = obj.get("world_size"), obj.get("ranks_per_node") or obj.get("world_size")
        if not isinstance(world, int) or world < 2 or not isinstance(per_node, int) or per_node < 1:
            raise UsageError(f"{where}: an all-reduce report needs world_size >= 2 and ranks_per_node")
        for row in obj.get("collectives", []):
            if row.get("method") != "plain":
                continue
            nbytes, seconds = row.get("size_bytes"), row.get("median_s")
            if not _positive(nbytes) or not _positive(seconds):
                raise UsageError(f"{where}: collectives row {row} needs positive size_bytes and median_s")
            measurements.collectives.append(CollectivePoint(float(nbytes), float(seconds), world, per_node))
        return
    if isinstance(obj, dict) and all(name in obj for name in SCALING_FIELDS):
        measurements.scaling_rows.append(obj)
        return
    raise UsageError(
        f"{where} is neither benchmarks/allreduce.py's report nor a scaling-suite row "
        f"(which has at least {', '.join(SCALING_FIELDS)})"
    )


def _positive(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and value > 0


def fit_line(x: list[float], y: list[float], relative: bool = True) -> tuple[float, float]:
    """Least-squares ``(intercept, slope)`` of ``y = intercept + slope x``, minimising
    relative errors when ``relative``; the intercept is kept non-negative (a fit below zero
    is refitted through the origin)."""
    if len(x) != len(y) or len(x) < 2:
        raise ValueError("a line needs at least two points")
    weights = [1.0 / v**2 if relative else 1.0 for v in y]
    sw = sum(weights)
    sx = sum(w * a for w, a in zip(weights, x))
    sy = sum(w * b for w, b in zip(weights, y))
    sxx = sum(w * a * a for w, a in zip(weights, x))
    sxy = sum(w * a * b for w, a, b in zip(weights, x, y))
    determinant = sw * sxx - sx * sx
    if determinant <= 0:
        raise ValueError("the points need at least two distinct x values")
    slope = (sw * sxy - sx * sy) / determinant
    intercept = (sy - slope * sx) / sw
    if intercept < 0:
        intercept, slope = 0.0, sxy / sxx
    return intercept, slope


def fit_alpha_beta(points: list[CollectivePoint]) -> tuple[float, float]:
    """``(alpha, beta)`` of ``time = alpha + bytes x beta`` over all-reduce points of one world size."""
    return fit_line([p.nbytes for p in points], [p.seconds for p in points])


def link_from_allreduce(alpha: float, beta: float, ranks: int) -> Link:
    """The per-step latency and bus bandwidth of a ring all-reduce that costs ``alpha + n x beta``
    over ``ranks`` ranks: ``alpha = 2 (p-1) latency``, ``beta = 2 (p-1)/p / bandwidth``."""
    steps = 2 * (ranks - 1)
    return Link(latency_s=alpha / steps, bandwidth_Bps=steps / ranks / beta)


def calibrate(measurements: Measurements, vocab_size: int | None = None) -> Calibration:
    """Fit links from the all-reduce points (one-node reports: the intra-node link; multi-node:
    the network) and achieved FLOP/s and memory bandwidth from one-rank scaling rows."""
    result = Calibration()
    by_layout: dict[tuple[int, int], list[CollectivePoint]] = {}
    for point in measurements.collectives:
        by_layout.setdefault((point.ranks, point.ranks_per_node), []).append(point)
    for (ranks, per_node), points in sorted(by_layout.items()):
        if len({p.nbytes for p in points}) < 2:
            raise UsageError(f"--calibrate: the {ranks}-rank all-reduce report needs at least two buffer sizes to fit")
        alpha, beta = fit_alpha_beta(points)
        if beta <= 0:
            raise UsageError(
                f"--calibrate: the {ranks}-rank all-reduce times do not grow with size; cannot fit a bandwidth"
            )
        link = link_from_allreduce(alpha, beta, ranks)
        worst = max(abs(alpha + beta * p.nbytes - p.seconds) / p.seconds for p in points)
        across_nodes = per_node < ranks
        if across_nodes:
            # A flat ring over several nodes runs at the node network's pace (see model.group_link).
            result.inter = link
        else:
            result.intra = link
        result.notes.append(
            f"{'network' if across_nodes else 'intra-node link'} from {len(points)} all-reduce sizes at {ranks} ranks: "
            f"latency {link.latency_s * 1e6:.1f} us per step, bandwidth {link.bandwidth_Bps / 1e9:.3f} GB/s "
            f"(fit within {worst:.0%} of every point)"
        )

    rates: dict[str, list[float]] = {}
    bandwidths: list[float] = []
    for row in measurements.scaling_rows:
        if row["world_size"] != 1:
            continue
        try:
            shape = model_shape(row["arch"], row.get("vocab_size", vocab_size))
            tokens = int(row["tokens_per_sample"])
            samples = int(row["batch_size"]) * int(row.get("update_freq", 1))
            precision = dtype_name(row.get("precision", "fp32"))
        except KeyError as exc:
            raise UsageError(f"--calibrate: a one-rank scaling row lacks {exc.args[0]}: {row}") from None
        if _positive(row.get("compute_s")):
            flops = samples * tokens * executed_flops_per_token(shape, tokens)
            rates.setdefault(precision, []).append(flops / row["compute_s"])
        if _positive(row.get("optimizer_s")):
            bandwidths.append(count_parameters(shape) * ADAM_BYTES_PER_PARAM / row["optimizer_s"])
    for precision, values in rates.items():
        result.achieved_flops[precision] = statistics.median(values)
        result.notes.append(
            f"achieved {precision} compute from {len(values)} one-rank rows: "
            f"{result.achieved_flops[precision] / 1e9:.1f} GFLOP/s"
        )
    if bandwidths:
        result.memory_bandwidth_Bps = statistics.median(bandwidths)
        result.notes.append(f"optimizer step at {result.memory_bandwidth_Bps / 1e9:.2f} GB/s of parameter state")
    if not result.notes:
        raise UsageError("--calibrate: nothing to fit: no plain all-reduce points and no one-rank scaling rows")
    return result
