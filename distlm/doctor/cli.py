"""``python -m distlm.doctor``: parse, start the process group as training would, run the checks, report."""

from __future__ import annotations

import argparse
import logging
import math
import os
import sys
from dataclasses import dataclass
from typing import NoReturn, Sequence

from distlm.backends import resolve_device
from distlm.backends.hardware import instance_type
from distlm.config import TrainConfig, default_save_dir, parse_args
from distlm.doctor.allreduce import DEFAULT_MIN_FRACTION, DEFAULT_REPEATS, DEFAULT_SIZES_MIB
from distlm.doctor.checks import run_doctor
from distlm.errors import (
    OneLineErrorParser,
    UsageError,
    exit_without_teardown,
    rank_from_environment,
    report_usage_error,
)
from distlm.plan import available_clusters, load_cluster
from distlm.runtime.context import shutdown

ENV_CLUSTER = "DISTLM_CLUSTER"
DETECTED = "the instance type"
"""Where a profile came from when nothing names one: this EC2 instance's own type has a profile."""
DEFAULT_TIMEOUT_SEC = "60"

DESCRIPTION = """\
Preflight of a cluster. Start it exactly as the training job, with the same launcher
(torchrun, srun, mpiexec) and the same command line, distlm.train replaced by
distlm.doctor. Every rank runs the checks; rank 0 prints one row per check:

  launcher         every rank detected the same launcher, world size, master, nodes, torch
  devices          the device each rank uses; no two ranks share a GPU; same hardware everywhere
  save dir         --save-dir is one file system: rank 0's file is read by every rank and
                   theirs by rank 0 (probe files removed afterwards)
  efa libfabric    on EFA hosts: fi_info -p efa finds the EFA provider on every host
  nccl net plugin  on EFA hosts with --device cuda: NCCL can load aws-ofi-nccl (libnccl-net.so)
  efa variables    on EFA hosts with an accelerator: the variables distlm's EFA preset set,
                   those you set, and where yours override it
  all-reduce       bus bandwidth 2(n-1)/n x bytes / time at several sizes (median, slowest
                   rank), compared with the --cluster profile when one is named (else
                   $DISTLM_CLUSTER, else this EC2 instance type's own profile)

A rank that does not reach a check within --timeout-sec is named and the check fails.
Exit status: 0 all checks passed (warnings and skips allowed), 1 a check failed, 2 bad input.

Training flags: every flag of `python -m distlm.train` is accepted and validated as training
validates it (see its --help). The doctor acts on --device, --network, --save-dir,
--no-save and the fairseq launch flags (--distributed-world-size/-rank/-init-method), and on
the same settings in --config; the others only have to be valid.
"""


@dataclass(frozen=True)
class DoctorOptions:
    """The doctor's own flags."""

    cluster: str | None
    cluster_source: str
    json: bool
    sizes_bytes: tuple[int, ...]
    repeats: int
    min_fraction: float


def build_parser() -> argparse.ArgumentParser:

    parser = OneLineErrorParser(
        prog="python -m distlm.doctor",
        usage="%(prog)s [doctor options] [training flags]",
        description=DESCRIPTION,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        allow_abbrev=False,
    )
    group = parser.add_argument_group("doctor options")
    group.add_argument(
        "--cluster", metavar="PROFILE",
        help=f"cluster profile of these nodes, e.g. p4d.24xlarge (python -m distlm.plan lists them) or a profile "
             f".toml file; the all-reduce's bus bandwidth is compared with it (default: ${ENV_CLUSTER}; "
             "neither: reported without a verdict)",
    )
    group.add_argument("--json", action="store_true", help="print the result as one JSON object instead of a table")
    group.add_argument(
        "--allreduce-mib", metavar="MIB[,MIB...]", default=",".join(f"{s:g}" for s in DEFAULT_SIZES_MIB),
        help="all-reduce sizes in MiB (default: %(default)s); the largest is compared with --cluster",
    )
    group.add_argument(
        "--allreduce-repeats", metavar="N", default=str(DEFAULT_REPEATS),
        help="timed repetitions of each size, after one warm-up (default: %(default)s)",
    )
    group.add_argument(
        "--min-busbw-fraction", metavar="F", default=str(DEFAULT_MIN_FRACTION),
        help="fail when the bus bandwidth is below this fraction of the profile's (default: %(default)s)",
    )
    group.add_argument(
        "--timeout-sec", metavar="SEC", default=DEFAULT_TIMEOUT_SEC,
        help="how long any step waits for the other ranks, rendezvous included (default: %(default)s; "
             "training's --timeout-sec and --config value are not used, so a missing rank is named quickly)",
    )
    return parser


# The all-reduce buffer is allocated whole at the largest size: this is far above where
# bus bandwidth levels off (hundreds of MiB) and below an accelerator's memory.
MAX_ALLREDUCE_MIB = 16384
MAX_REPEATS = 10000


def _parse_sizes(raw: str) -> tuple[int, ...]:
    fix = "give sizes in MiB separated by commas, e.g. --allreduce-mib 1,4,16,64"
    sizes = []
    for item in raw.split(","):
        try:
            mib = float(item)
        except ValueError:
            raise UsageError(f"--allreduce-mib {raw!r}: {item.strip()!r} is not a number; {fix}") from None
        # Checked before int(): int() of inf or nan raises.
        if not (math.isfinite(mib) and mib <= MAX_ALLREDUCE_MIB and int(mib * 1024**2) >= 4):
            raise UsageError(
                f"--allreduce-mib {raw!r}: {item.strip()} MiB is not a positive size from 4 bytes to "
                f"{MAX_ALLREDUCE_MIB} MiB; {fix}"
            )
        sizes.append(int(mib * 1024**2) // 4 * 4)  # whole fp32 elements
    return tuple(sorted(set(sizes)))


def _parse_number(raw: str, flag: str, kind: type, low: float, high: float = math.inf) -> float:
    try:
        value = kind(raw)
    except ValueError:
        raise UsageError(f"{flag}: cannot parse {raw!r} as {'an integer' if kind is int else 'a number'}") from None
    if not (math.isfinite(value) and low <= value <= high):
        bounds = f"at least {low:g}" if high == math.inf else f"in [{low:g}, {high:g}]"
        raise UsageError(f"{flag} must be {bounds}, got {raw}")
    return value


def _parse_repeats(raw: str) -> int:
    repeats = int(_parse_number(raw, "--allreduce-repeats", int, 1))
    if repeats > MAX_REPEATS:
        raise UsageError(f"--allreduce-repeats must be in [1, {MAX_REPEATS}], got {raw}")
    return repeats


def parse_doctor_args(argv: Sequence[str] | None = None) -> tuple[DoctorOptions, TrainConfig]:
    """The doctor's flags, and the training config from everything else (validated as training does)."""

    args, training_argv = build_parser().parse_known_args(list(sys.argv[1:] if argv is None else argv))
    # The doctor's timeout goes through training's parser, so it is checked by the same rule.
    config = parse_args([*training_argv, "--timeout-sec", args.timeout_sec])
    if config.checkpoint.save_dir is None:
        # The directory the job writes without --save-dir (checkpoints/MODEL), as the Trainer fills it in.
        config.checkpoint.save_dir = default_save_dir(config)
    cluster, source = args.cluster, "--cluster"
    if cluster is None and os.environ.get(ENV_CLUSTER):
        cluster, source = os.environ[ENV_CLUSTER], ENV_CLUSTER
    detected = instance_type() if cluster is None else None
    if detected in available_clusters():
        cluster, source = detected, DETECTED
    options = DoctorOptions(
        cluster=cluster,
        cluster_source=source,
        json=args.json,
        sizes_bytes=_parse_sizes(args.allreduce_mib),
        repeats=_parse_repeats(args.allreduce_repeats),
        min_fraction=_parse_number(args.min_busbw_fraction, "--min-busbw-fraction", float, 0.0, 1.0),
    )
    return options, config


def load_expected_cluster(options: DoctorOptions, device: str):
    """The named cluster profile, checked against this job's device; None when none is named.

    Runs before the rendezvous, so a wrong profile is a one-line error on every rank alike.
    """
    if options.cluster is None:
        return None

    try:
        cluster = load_cluster(options.cluster)
    except UsageError as err:
        if options.cluster_source == "--cluster":
            raise
        raise UsageError(f"{err} (the profile came from ${ENV_CLUSTER})") from None
    resolved = resolve_device(device)
    if cluster.device_type != resolved and options.cluster_source == DETECTED:
        return None  # the instance's accelerators are not what this job runs on (a CPU job on a GPU node)
    if cluster.device_type != resolved:
        raise UsageError(
            f"{options.cluster_source} {options.cluster} describes {cluster.device_type} nodes but this job runs on "
            f"{resolved} (--device {device}); name the profile of these nodes, or none"
        )
    return cluster


def main(argv: Sequence[str] | None = None) -> int:
    """Run the doctor on this rank; returns the exit status (0 passed, 1 a check failed, 2 bad input)."""
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s | %(levelname)s | %(name)s | %(message)s",
                        stream=sys.stderr)
    rank = rank_from_environment()
    try:
        options, config = parse_doctor_args(argv)
        cluster = load_expected_cluster(options, config.distributed.device)

        return run_doctor(options, config, cluster, launcher_rank=rank)
    except UsageError as exc:
        return report_usage_error("distlm.doctor: error: ", exc, rank)
    finally:
        shutdown()


def run() -> NoReturn:
    """``python -m distlm.doctor``: ``main`` and an exit that skips the interpreter's teardown."""

    exit_without_teardown(main())
