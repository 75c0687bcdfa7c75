"""Entry point: ``torchrun -m distlm.train``, ``srun``/``mpiexec python -m distlm.train``, or plain ``python``.

Bad input ends the run with one line on stderr and exit status 2, before anything
distributed starts where possible; everything else is the Trainer's. The command line is
parsed and checked before torch, the models or the data are imported, so ``--help`` and a
refused flag answer at once instead of after seconds of imports.
"""

from __future__ import annotations

import logging
import signal
import sys
from typing import Sequence

from distlm.config import TrainConfig, parse_args
from distlm.errors import UsageError, exit_without_teardown, print_last_line, rank_from_environment, report_usage_error
from distlm.observe.log_lines import LOG_FORMAT
from distlm.runtime.signals import StoppedBeforeTraining, die_with_torchrun_agent, exit_status

ERROR_PREFIX = "distlm: error: "


def main(argv: Sequence[str] | None = None) -> int:
    die_with_torchrun_agent()  # first: a worker orphaned while it imports would train on alone
    rank = rank_from_environment()
    logging.basicConfig(
        level=logging.INFO if rank == 0 else logging.WARNING,
        format=LOG_FORMAT,
        stream=sys.stderr,
    )
    try:
        config = parse_args(argv)
    except KeyboardInterrupt:
        return interrupted_before_training(rank)
    except UsageError as exc:
        return report_usage_error(ERROR_PREFIX, exc, rank)
    return train(config, rank)


def train(config: TrainConfig, rank: int) -> int:
    """Train with a parsed ``config``; the exit status."""
    try:
        from distlm.backends.base import DistributedInitError
        from distlm.parallel.replicas import ReplicaDrift
        from distlm.runtime.context import CollectiveFailure, shutdown
        from distlm.training.divergence import DivergenceError
        from distlm.training.trainer import Trainer
    except KeyboardInterrupt:  # the imports take seconds
        return interrupted_before_training(rank)

    is_main = rank == 0
    try:
        trainer = Trainer(config)
        trainer.precompile() if config.compile.precompile else trainer.fit()
        if trainer.stop.agreed:
            status = exit_status(trainer.stop.agreed[0])
            if is_main:
                print_last_line(f"distlm: {trainer.stop_line()}", status, rank)
            return status
    except KeyboardInterrupt:
        return interrupted_before_training(rank)
    except StoppedBeforeTraining as exc:
        # A stop signal while a tracker started (the Trainer had taken the signals over).
        status = exit_status(exc.signum)
        if is_main:
            print_last_line(f"distlm: {exc}", status, rank)
        return status
    except UsageError as exc:
        return report_usage_error(ERROR_PREFIX, exc, rank)
    except DivergenceError as exc:
        # Every rank meets it at the same update; rank 0's line is enough.
        if is_main:
            print_last_line(f"{ERROR_PREFIX}{exc}", 1, rank)
        return 1
    except (DistributedInitError, CollectiveFailure, ReplicaDrift) as exc:
        # Start-up and collective failures already carry a one-line explanation naming
        # the ranks; every rank prints its own, since each may see a different peer fail.
        print_last_line(f"{ERROR_PREFIX}{exc}", 1, rank)
        return 1
    finally:
        shutdown()
    return 0


def interrupted_before_training(rank: int) -> int:
    """Ctrl-C before training started (the Trainer takes SIGINT over while it trains)."""
    status = exit_status(signal.SIGINT)
    if rank == 0:
        print_last_line("distlm: SIGINT before training started; nothing saved", status, rank)
    return status


def run() -> None:
    """``python -m distlm.train`` and the ``distlm-train`` command."""
    exit_without_teardown(main())


if __name__ == "__main__":
    run()
