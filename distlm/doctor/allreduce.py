"""Check: a timed all-reduce over the job's own process group, and its bus bandwidth.

Bus bandwidth is ``2 (n-1)/n x bytes / time``, the figure nccl-tests reports: what each
rank's link carried in a ring all-reduce, comparable across world sizes. Each size is
all-reduced once to warm up, then ``repeats`` times after a barrier; a repetition takes
as long as its slowest rank, and the median over repetitions is reported. The result is
checked too (every rank contributes rank + 1, so each element must be n (n+1) / 2).

Where the cluster profile is known (``--cluster`` or ``DISTLM_CLUSTER``), the largest
size's figure is compared with what the planner's alpha-beta model expects of a ring on
that profile's links (``distlm.plan``); otherwise it is reported without a verdict.
"""

from __future__ import annotations

import statistics
import time
from typing import Any, Sequence

import torch
import torch.distributed as dist

from distlm.doctor.channel import RankChannel, StepFailed
from distlm.doctor.report import FAIL, PASS, SKIP, Row, format_ranks
from distlm.errors import first_line
from distlm.plan.model import Cluster, Group, group_link, ring_allreduce_time

NAME = "all-reduce"
MIB = 1024**2
DEFAULT_SIZES_MIB = (1.0, 4.0, 16.0, 64.0)
DEFAULT_REPEATS = 5
DEFAULT_MIN_FRACTION = 0.5


def bus_bytes(nbytes: float, ranks: int) -> float:
    """Bytes a ring all-reduce of ``nbytes`` moves over each rank's link: ``2 (n-1)/n x nbytes``."""
    return 2 * (ranks - 1) / ranks * nbytes


def expected_bus_bandwidth(cluster: Cluster, nbytes: float, ranks: int, nodes: int) -> float:
    """Bus bandwidth (bytes/s) the planner expects of a ring all-reduce of ``nbytes`` on ``cluster``.

    The ring runs on the intra-node link inside one node and on the node's network
    across nodes (``distlm.plan.model.group_link``); its time includes the per-step latency.
    """
    link = group_link(Group(ranks=ranks, nodes=nodes), cluster)
    return bus_bytes(nbytes, ranks) / ring_allreduce_time(nbytes, ranks, link)


def time_allreduce(sizes: Sequence[int], repeats: int, device: torch.device, backend: Any, rank: int, world_size: int,
                   timeout_sec: float) -> tuple[list[list[float]], list[int]]:
    """Seconds of each repetition of each size on this rank, and the sizes whose result was wrong.

    Collective over the job's process group. A gloo collective that outlives
    ``timeout_sec`` raises; that becomes ``StepFailed``.
    """
    buffer = torch.empty(max(sizes) // 4, dtype=torch.float32, device=device)
    expected = world_size * (world_size + 1) / 2
    seconds: list[list[float]] = []
    wrong: list[int] = []
    try:
        for nbytes in sizes:
            view = buffer[: nbytes // 4]
            timings = []
            for repetition in range(repeats + 1):  # the first one warms up (connections, buffers)
                view.fill_(rank + 1)
                backend.mark_step()
                backend.synchronize()
                dist.barrier()
                start = time.perf_counter()
                dist.all_reduce(view)
                backend.mark_step()
                backend.synchronize()
                if repetition:
                    timings.append(time.perf_counter() - start)
            if not bool(view.eq(expected).all()):
                wrong.append(nbytes)
            seconds.append(timings)
    except RuntimeError as err:
        cause = first_line(err)
        raise StepFailed(
            f"rank {rank}: an all-reduce did not complete within --timeout-sec {timeout_sec:g}: {cause}"
        ) from err
    return seconds, wrong


def judge_allreduce(
    sizes: Sequence[int],
    per_rank_seconds: Sequence[Sequence[Sequence[float]]],
    wrong: Sequence[Sequence[int]],
    nodes: int,
    cluster: Cluster | None,
    min_fraction: float,
) -> Row:
    """FAIL on a wrong sum or, given a profile, a bus bandwidth below ``min_fraction`` of its figure."""
    ranks = len(per_rank_seconds)
    medians = [
        statistics.median(max(rank_seconds[size][rep] for rank_seconds in per_rank_seconds)
                          for rep in range(len(per_rank_seconds[0][size])))
        for size in range(len(sizes))
    ]
    bandwidths = [bus_bytes(nbytes, ranks) / seconds for nbytes, seconds in zip(sizes, medians)]
    data: dict[str, Any] = {
        "sizes_bytes": list(sizes),
        "median_seconds": medians,
        "bus_GBps": [b / 1e9 for b in bandwidths],
        "cluster": cluster.name if cluster else None,
        "expected_bus_GBps": None,
    }
    figures = ", ".join(f"{_mib(n)} {b / 1e9:.3g}" for n, b in zip(sizes, bandwidths))
    measured = f"bus bandwidth GB/s (median, slowest rank) {figures}"
    bad = sorted({rank for rank, sizes_wrong in enumerate(wrong) if sizes_wrong})
    if bad:
        return Row(
            NAME, FAIL, f"wrong sums on ranks {format_ranks(bad)}: the transport corrupts data; {measured}", data
        )
    if cluster is None:
        return Row(NAME, PASS, f"{measured}; no --cluster profile to compare with", data)
    expected = expected_bus_bandwidth(cluster, sizes[-1], ranks, nodes)
    data["expected_bus_GBps"] = expected / 1e9
    fraction = bandwidths[-1] / expected
    data["fraction_of_expected"] = fraction
    comparison = (
        f"{_mib(sizes[-1])}: {fraction:.2g} of the {expected / 1e9:.3g} GB/s that {cluster.name} should give "
        f"{ranks} ranks on {nodes} node{'s' if nodes > 1 else ''}"
    )
    if fraction < min_fraction:
        return Row(
            NAME,
            FAIL,
            f"{comparison}, below --min-busbw-fraction {min_fraction:g} (wrong network, e.g. TCP instead of EFA? "
            f"see the efa rows); {measured}",
            data,
        )
    return Row(NAME, PASS, f"{comparison}; {measured}", data)


def _mib(nbytes: int) -> str:
    return f"{nbytes / MIB:g} MiB"


def check_allreduce(
    channel: RankChannel,
    context: Any,
    sizes: Sequence[int],
    repeats: int,
    cluster: Cluster | None,
    min_fraction: float,
) -> list[Row]:
    """Time all-reduces over ``context``'s process group and judge them (collective)."""
    if not context.is_distributed:
        return [Row(NAME, SKIP, "one rank: nothing to all-reduce")]
    channel.wait_for_all(NAME)
    seconds, wrong = time_allreduce(
        sizes, repeats, context.device, context.backend, context.rank, context.world_size, channel.timeout_sec
    )
    results = channel.gather((seconds, wrong), NAME)
    return [
        judge_allreduce(
            sizes, [r[0] for r in results], [r[1] for r in results], context.env.num_nodes, cluster, min_fraction
        )
    ]
