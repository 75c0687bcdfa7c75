"""The doctor's run: start the process group as training does, run every check in order, report.

Every rank runs every check and judges the gathered results alike, so all ranks exit
with the same status; rank 0 prints. When a step fails for want of a rank (or a
collective breaks), that check fails naming whom it waited for, and the checks after it
are skipped: the process group cannot be trusted any more.
"""

from __future__ import annotations

import os
import sys
from typing import Any, Callable, Sequence

from distlm.backends.base import DistributedInitError
from distlm.config import TrainConfig
from distlm.doctor import allreduce, devices, efa, launcher, save_dir
from distlm.doctor.channel import RankChannel, StepFailed
from distlm.doctor.report import FAIL, SKIP, Row, count, exit_status, render_json, render_table
from distlm.training.startup import start_run

RENDEZVOUS = "rendezvous"


def _gpudirect_rdma(context: Any) -> bool | None:
    """Whether the backend puts EFA RDMA in its preset for this rank's device; None if it does not say."""
    answer = getattr(context.backend, "supports_gpudirect_rdma", None)
    if answer is None or context.device.index is None:
        return None
    return bool(answer(context.device.index))


def plan_checks(options: Any, config: TrainConfig, cluster: Any, context: Any,
                environ_before: dict[str, str]) -> list[tuple[tuple[str, ...], Callable[[RankChannel], list[Row]]]]:
    """The checks in order: the row names each produces, and how to run it over a channel."""
    settings = config.distributed
    return [
        ((launcher.NAME,), lambda channel: launcher.check_launcher(channel, context.env)),
        ((devices.NAME,), lambda channel: devices.check_devices(channel, context.backend.name, context.device)),
        (
            (save_dir.NAME,),
            lambda channel: save_dir.check_save_dir(channel, config.checkpoint.save_dir, config.checkpoint.no_save),
        ),
        (
            efa.NAMES,
            lambda channel: efa.check_efa(
                channel, context.backend.dist_backend, _gpudirect_rdma(context), settings.network, environ_before
            ),
        ),
        (
            (allreduce.NAME,),
            lambda channel: allreduce.check_allreduce(
                channel, context, options.sizes_bytes, options.repeats, cluster, options.min_fraction
            ),
        ),
    ]


def run_checks(channel: RankChannel, checks: Sequence[tuple[tuple[str, ...], Callable]]) -> list[Row]:
    """Every check's rows; after a failed step, that check fails and the rest are skipped."""
    rows: list[Row] = []
    for position, (names, check) in enumerate(checks):
        try:
            rows += check(channel)
        except StepFailed as err:
            rows.append(Row(names[0], FAIL, str(err)))
            skipped = [*names[1:], *(name for later, _ in checks[position + 1:] for name in later)]
            rows += [Row(name, SKIP, "not run: a rank is missing") for name in skipped]
            if channel.rank != 0:
                print(f"distlm.doctor: error: {err}", file=sys.stderr, flush=True)
            break
    return rows


def print_report(rows: Sequence[Row], launch: dict[str, Any], as_json: bool) -> None:
    """The table (or JSON) rank 0 prints."""
    if launch["world_size"] is None:
        header = f"distlm doctor: no process group (--device {launch['device']})"
    else:
        header = (
            f"distlm doctor: {count(launch['world_size'], 'rank')}, device {launch['device']} "
            f"({launch['process_group']}), --timeout-sec {launch['timeout_sec']:g}"
        )
    print(render_json(rows, launch) if as_json else render_table(rows, header), flush=True)


def run_doctor(options: Any, config: TrainConfig, cluster: Any, launcher_rank: int = 0) -> int:
    """Start the process group, run the checks, print on rank 0; the exit status (0 or 1).

    ``launcher_rank`` is the rank the launcher's variables give, which decides who prints
    when the process group never started.
    """

    # Before start_run: the backend's network preset adds variables, and the
    # efa variables row tells those apart from the user's own.
    environ_before = dict(os.environ)
    try:
        context = start_run(config, agree=False).context
    except DistributedInitError as err:
        rows = [Row(RENDEZVOUS, FAIL, str(err))]
        if launcher_rank == 0:
            launch = {"describe": None, "world_size": None, "device": config.distributed.device,
                      "process_group": None, "timeout_sec": config.distributed.timeout_sec}
            print_report(rows, launch, options.json)
        else:
            print(f"distlm.doctor: error: {err}", file=sys.stderr, flush=True)
        return exit_status(rows)
    launch = {
        "describe": context.env.describe(),
        "world_size": context.world_size,
        "device": str(context.device),
        "process_group": context.backend.dist_backend,
        "timeout_sec": context.timeout.total_seconds(),
    }
    try:
        channel = RankChannel.for_context(context)
    except StepFailed as err:
        rows = [Row(RENDEZVOUS, FAIL, str(err))]
    else:
        rows = run_checks(channel, plan_checks(options, config, cluster, context, environ_before))
    if context.is_main:
        print_report(rows, launch, options.json)
    return exit_status(rows)
