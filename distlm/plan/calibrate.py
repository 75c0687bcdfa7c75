"""Fit the planner's alpha, beta and achieved FLOP/s to measurements.

Two kinds of JSON objects are read from one file, in any order, one per line or pretty
printed one after another:

* the report ``benchmarks/allreduce.py`` prints (``"benchmark": "allreduce"``), and the
  scaling suite's collective probe in the same format: its flat all-reduce points
  (``collectives`` rows of method ``plain``) give the link; rows of method ``all_gather``
  (``size_bytes``: the gathered output) and ``reduce_scatter`` (the reduced input), which
  the suite's probe adds, give those collectives their own costs;
* rows of the scaling suite (``world_size``, ``strategy``, ``tokens_per_s``, ``step_time_s``,
  ``compute_s``, ``comm_exposed_s``, ``optimizer_s``, ``memory_bytes_per_rank``, ``mfu``,
  ``efficiency``, ``arch``, ``batch_size``, ``tokens_per_sample``, ``precision``): their
  one-rank rows give the achieved FLOP/s (the FLOPs the step runs over its compute time),
  the optimizer's memory bandwidth, the optimizer step's extra cost per parameter tensor
  on DTensors (``dtensor_optimizer_overhead_s``), and (``threads_per_rank``, ``host_cores``) how many
  threads a rank computed with on how many cores;
* the suite's host-sharing rows (``"benchmark": "host_sharing"``): the one-rank update run by
  ``processes`` independent launches at once on the host, nothing communicated; against
  the one-rank rows they give how much slower compute (the expected slowest of that many,
  as a synchronised update waits for it) and the optimizer step run when that many ranks
  share the host's cores, caches and memory.

Each collective's fit is least squares of ``time = alpha + bytes x beta`` in relative error
(every size weighs alike, from 64 KiB to 256 MiB), per collective and layout; the planner
uses it for a group of that shape. The all-reduce fit of the fewest ranks is also read
through the ring formula ``2 (p-1) latency + 2 (p-1)/p x n / bandwidth`` as a per-step
latency and a bus bandwidth: the link, for groups no probe measured.
"""

from __future__ import annotations

import dataclasses
import json
import statistics
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from distlm.choices import COLLECTIVE_OF_PROBE_METHOD
from distlm.errors import UsageError
from distlm.models.flops import ModelShape, count_parameter_tensors, count_parameters, model_shape
from distlm.plan.model import ADAM_BYTES_PER_PARAM, Cluster, Link, executed_flops_per_token
from distlm.precision import dtype_name

SCALING_FIELDS = ("world_size", "strategy", "tokens_per_s", "step_time_s", "compute_s")


@dataclass(frozen=True)
class CollectivePoint:
    """One timed collective: ``nbytes`` over ``ranks`` ranks (``ranks_per_node`` per node) in ``seconds``."""

    nbytes: float
    seconds: float
    ranks: int
    ranks_per_node: int
    kind: str = "all_reduce"
    """``all_reduce``, ``all_gather`` (``nbytes``: the gathered output) or ``reduce_scatter`` (the input)."""


@dataclass
class Measurements:
    collectives: list[CollectivePoint] = field(default_factory=list)
    scaling_rows: list[dict[str, Any]] = field(default_factory=list)
    host_sharing: list[dict[str, Any]] = field(default_factory=list)


@dataclass
class Calibration:
    """What the measurements fixed; ``None`` where they said nothing."""

    intra: Link | None = None
    inter: Link | None = None
    collectives: dict[tuple[str, int, int], tuple[float, float]] = field(default_factory=dict)
    """``(collective, ranks, ranks per node) -> (alpha, beta)`` of each probed layout."""
    achieved_flops: dict[str, float] = field(default_factory=dict)
    memory_bandwidth_Bps: float | None = None
    host_sharing: dict[int, tuple[float, float]] = field(default_factory=dict)
    """``processes -> (compute, optimizer)``: how much slower each runs when that many
    one-rank updates share the host than one alone."""
    dtensor_step_per_tensor_s: float | None = None
    threads_per_rank: int | None = None
    """Threads each rank computed with in the one-rank rows (the achieved FLOP/s are theirs)."""
    host_cores: int | None = None
    """Cores of the host the one-rank rows ran on."""
    notes: list[str] = field(default_factory=list)

    def apply(self, cluster: Cluster) -> Cluster:
        """``cluster`` with the calibrated numbers in place of its profile's. A CPU cluster
        also takes the measured threads per rank and cores: the achieved FLOP/s hold for them."""
        cpu = cluster.device_type == "cpu"
        return dataclasses.replace(
            cluster,
            intra=self.intra or cluster.intra,
            inter=self.inter or cluster.inter,
            measured_collectives={**cluster.measured_collectives, **self.collectives},
            achieved_flops={**cluster.achieved_flops, **self.achieved_flops},
            memory_bandwidth_Bps=self.memory_bandwidth_Bps or cluster.memory_bandwidth_Bps,
            measured_host_sharing={**cluster.measured_host_sharing, **self.host_sharing} if cpu
            else cluster.measured_host_sharing,
            dtensor_step_per_tensor_s=(cluster.dtensor_step_per_tensor_s if self.dtensor_step_per_tensor_s is None
                                       else self.dtensor_step_per_tensor_s),
            cpu_threads_per_rank=(self.threads_per_rank if cpu and self.threads_per_rank
                                  else cluster.cpu_threads_per_rank),
            cores_per_node=self.host_cores if cpu and self.host_cores else cluster.cores_per_node,
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
            kind = COLLECTIVE_OF_PROBE_METHOD.get(row.get("method"))
            if kind is None:  # fp16, hierarchical, ...: distlm's own reducers, not the plain collectives
                continue
            nbytes, seconds = row.get("size_bytes"), row.get("median_s")
            if not _positive(nbytes) or not _positive(seconds):
                raise UsageError(f"{where}: collectives row {row} needs positive size_bytes and median_s")
            measurements.collectives.append(CollectivePoint(float(nbytes), float(seconds), world, per_node, kind))
        return
    if isinstance(obj, dict) and obj.get("benchmark") == "host_sharing":
        for name in ("processes", "arch", "tokens_per_sample", "batch_size", "compute_s", "optimizer_s"):
            if name not in obj:
                raise UsageError(f"{where}: a host-sharing row needs {name}")
        measurements.host_sharing.append(obj)
        return
    if isinstance(obj, dict) and all(name in obj for name in SCALING_FIELDS):
        measurements.scaling_rows.append(obj)
        return
    raise UsageError(
        f"{where} is neither benchmarks/allreduce.py's report, a scaling-suite row "
        f"(which has at least {', '.join(SCALING_FIELDS)}) nor a host-sharing row"
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
    """``(alpha, beta)`` of ``time = alpha + bytes x beta`` over points of one collective and layout."""
    return fit_line([p.nbytes for p in points], [p.seconds for p in points])


def link_from_allreduce(alpha: float, beta: float, ranks: int) -> Link:
    """The per-step latency and bus bandwidth of a ring all-reduce that costs ``alpha + n x beta``
    over ``ranks`` ranks: ``alpha = 2 (p-1) latency``, ``beta = 2 (p-1)/p / bandwidth``."""
    steps = 2 * (ranks - 1)
    return Link(latency_s=alpha / steps, bandwidth_Bps=steps / ranks / beta)


def calibrate(measurements: Measurements, vocab_size: int | None = None) -> Calibration:
    """Fit each probed collective and layout, the links (the all-reduce of the fewest ranks
    in one node: the intra-node link; across nodes: the network), and achieved FLOP/s,
    memory bandwidth, threads and cores from one-rank scaling rows."""
    result = Calibration()
    by_layout: dict[tuple[str, int, int], list[CollectivePoint]] = {}
    for point in measurements.collectives:
        by_layout.setdefault((point.kind, point.ranks, point.ranks_per_node), []).append(point)
    for (kind, ranks, per_node), points in sorted(by_layout.items(), key=lambda item: (item[0][1], item[0])):
        name = kind.replace("_", "-")
        if len({p.nbytes for p in points}) < 2:
            raise UsageError(f"--calibrate: the {ranks}-rank {name} report needs at least two buffer sizes to fit")
        alpha, beta = fit_alpha_beta(points)
        if beta <= 0:
            raise UsageError(
                f"--calibrate: the {ranks}-rank {name} times do not grow with size; cannot fit a bandwidth"
            )
        result.collectives[(kind, ranks, per_node)] = (alpha, beta)
        worst = max(abs(alpha + beta * p.nbytes - p.seconds) / p.seconds for p in points)
        across_nodes = per_node < ranks
        where = f"{ranks} ranks" + (f" ({per_node} per node)" if across_nodes else "")
        result.notes.append(
            f"{name} at {where} from {len(points)} sizes: {alpha * 1e6:.0f} us + bytes at {1 / beta / 1e9:.3f} GB/s "
            f"(fit within {worst:.0%} of every point)"
        )
        if kind != "all_reduce" or (result.inter if across_nodes else result.intra) is not None:
            continue
        # The fewest ranks set the link for groups no probe measured.
        link = link_from_allreduce(alpha, beta, ranks)
        if across_nodes:
            # A flat ring over several nodes runs at the node network's pace (see model.group_link).
            result.inter = link
        else:
            result.intra = link
        result.notes.append(
            f"{'network' if across_nodes else 'intra-node link'} from the {ranks}-rank all-reduce: "
            f"latency {link.latency_s * 1e6:.1f} us per step, bandwidth {link.bandwidth_Bps / 1e9:.3f} GB/s"
        )

    rates: dict[str, list[float]] = {}
    bandwidths: list[float] = []
    per_tensor: list[float] = []
    threads: set[int] = set()
    cores: set[int] = set()
    for row in measurements.scaling_rows:
        if row["world_size"] != 1:
            continue
        if isinstance(row.get("threads_per_rank"), int) and row["threads_per_rank"] > 0:
            threads.add(row["threads_per_rank"])
        if isinstance(row.get("host_cores"), int) and row["host_cores"] > 0:
            cores.add(row["host_cores"])
        try:
            shape, flops, precision = _update_work(row, vocab_size)
        except KeyError as exc:
            raise UsageError(f"--calibrate: a one-rank scaling row lacks {exc.args[0]}: {row}") from None
        if _positive(row.get("compute_s")):
            rates.setdefault(precision, []).append(flops / row["compute_s"])
        if _positive(row.get("optimizer_s")):
            bandwidths.append(optimizer_bandwidth(shape, row["optimizer_s"]))
        overhead = row.get("dtensor_optimizer_overhead_s")
        if isinstance(overhead, (int, float)) and not isinstance(overhead, bool):
            # Timing noise can make a negligible overhead come out below zero.
            per_tensor.append(max(0.0, overhead) / count_parameter_tensors(shape))
    for precision, values in rates.items():
        result.achieved_flops[precision] = statistics.median(values)
        result.notes.append(
            f"achieved {precision} compute from {len(values)} one-rank rows: "
            f"{result.achieved_flops[precision] / 1e9:.1f} GFLOP/s"
        )
    if bandwidths:
        result.memory_bandwidth_Bps = statistics.median(bandwidths)
        result.notes.append(f"optimizer step at {result.memory_bandwidth_Bps / 1e9:.2f} GB/s of parameter state")
    if per_tensor:
        result.dtensor_step_per_tensor_s = statistics.median(per_tensor)
        result.notes.append(
            f"optimizer step on DTensors (FSDP, tensor parallel): {result.dtensor_step_per_tensor_s * 1e6:.1f} us "
            "more per parameter tensor"
        )
    _fit_host_sharing(measurements.host_sharing, result, vocab_size, threads)
    if len(threads) > 1 or len(cores) > 1:
        raise UsageError(
            f"--calibrate: the one-rank rows ran with {sorted(threads)} threads per rank on {sorted(cores)} cores; "
            "calibrate from rows of one setting"
        )
    if threads:
        result.threads_per_rank = threads.pop()
    if cores:
        result.host_cores = cores.pop()
    if result.threads_per_rank or result.host_cores:
        result.notes.append(
            f"one-rank rows: {result.threads_per_rank or '?'} thread(s) per rank on {result.host_cores or '?'} cores"
        )
    if not result.notes:
        raise UsageError("--calibrate: nothing to fit: no plain all-reduce points and no one-rank scaling rows")
    return result


def update_flops(shape: ModelShape, tokens_per_sample: int, samples: int) -> float:
    """FLOPs one update of ``samples`` samples runs (forward and backward, as the planner
    times them); over its measured compute seconds, the achieved FLOP/s."""
    return samples * tokens_per_sample * executed_flops_per_token(shape, tokens_per_sample)


def optimizer_bandwidth(shape: ModelShape, optimizer_s: float) -> float:
    """Bytes per second an optimizer step (clipping and AdamW over every parameter) of
    ``optimizer_s`` seconds implies: the planner's memory bandwidth."""
    return count_parameters(shape) * ADAM_BYTES_PER_PARAM / optimizer_s


def _update_work(row: dict[str, Any], vocab_size: int | None) -> tuple[ModelShape, float, str]:
    """The model shape, FLOPs run per update and precision of a scaling or host-sharing row."""
    shape = model_shape(row["arch"], row.get("vocab_size", vocab_size))
    tokens = int(row["tokens_per_sample"])
    samples = int(row["batch_size"]) * int(row.get("update_freq", 1))
    return shape, update_flops(shape, tokens, samples), dtype_name(row.get("precision", "fp32"))


def _fit_host_sharing(
    rows: list[dict[str, Any]], result: Calibration, vocab_size: int | None, one_rank_threads: set[int]
) -> None:
    """Per count of concurrent one-rank updates, their compute and optimizer slowdowns
    against the one-rank rows: achieved FLOP/s (the batches may differ) and optimizer
    seconds (the same parameters). Compute is the expected slowest of that many updates
    (``slowest_compute_s``, where given): ranks that synchronise every update wait for it."""
    if not rows:
        return
    if not result.achieved_flops or result.memory_bandwidth_Bps is None:
        raise UsageError("--calibrate: host-sharing rows need the one-rank scaling rows they compare with")
    factors: dict[int, list[tuple[float, float]]] = {}
    for row in rows:
        if one_rank_threads and row.get("threads_per_rank") not in one_rank_threads:
            raise UsageError(
                f"--calibrate: a host-sharing row ran {row.get('threads_per_rank')} threads per rank, the one-rank "
                f"rows {sorted(one_rank_threads)}; calibrate from rows of one setting"
            )
        shape, flops, precision = _update_work(row, vocab_size)
        compute = row.get("slowest_compute_s", row["compute_s"])
        if precision not in result.achieved_flops or not (_positive(compute) and _positive(row["optimizer_s"])):
            continue
        achieved = flops / compute
        alone_optimizer = count_parameters(shape) * ADAM_BYTES_PER_PARAM / result.memory_bandwidth_Bps
        factors.setdefault(int(row["processes"]), []).append(
            (result.achieved_flops[precision] / achieved, row["optimizer_s"] / alone_optimizer)
        )
    for processes, values in sorted(factors.items()):
        compute = statistics.median(value[0] for value in values)
        optimizer = statistics.median(value[1] for value in values)
        result.host_sharing[processes] = (compute, optimizer)
        result.notes.append(
            f"{processes} one-rank updates at once: compute {compute:.2f}x, optimizer {optimizer:.2f}x one alone"
        )
