"""Entry point: ``torchrun -m distlm.train``, ``srun``/``mpiexec python -m distlm.train``, or plain ``python``.

Bad input ends the run with one line on stderr and exit status 2, before anything
distributed starts where possible; everything else is the Trainer's.
"""

from __future__ import annotations

import logging
import signal
import sys
from typing import Sequence

from distlm.backends.base import DistributedInitError
from distlm.config import parse_args
from distlm.distributed import CollectiveFailure, shutdown
from distlm.divergence import DivergenceError
from distlm.errors import UsageError, exit_without_teardown, rank_from_environment, report_usage_error
from distlm.parallel.replicas import ReplicaDrift
from distlm.signals import StoppedBeforeTraining, exit_status
from distlm.trainer import Trainer


def main(argv: Sequence[str] | None = None) -> int:
    rank = rank_from_environment()
    is_main = rank == 0
    logging.basicConfig(
        level=logging.INFO if is_main else logging.WARNING,
        format="%(asctime)s | %(levelname)s | %(name)s | %(message)s",
        stream=sys.stderr,
    )
    try:
        config = parse_args(argv)
        trainer = Trainer(config)
        trainer.precompile() if config.compile.precompile else trainer.fit()
        if trainer.stop.agreed:
            if is_main:
                print(f"distlm: {trainer.stop_line()}", file=sys.stderr, flush=True)
            return exit_status(trainer.stop.agreed[0])
    except KeyboardInterrupt:
        # Ctrl-C before training started (the Trainer takes SIGINT over while it trains).
        if is_main:
            print("distlm: SIGINT before training started; nothing saved", file=sys.stderr, flush=True)
        return exit_status(signal.SIGINT)
    except StoppedBeforeTraining as exc:
        # A stop signal while a tracker started (the Trainer had taken the signals over).
        if is_main:
            print(f"distlm: {exc}", file=sys.stderr, flush=True)
        return exit_status(exc.signum)
    except UsageError as exc:
        return report_usage_error("distlm: error: ", exc, rank)
    except DivergenceError as exc:
        # Every rank meets it at the same update; rank 0's line is enough.
        if is_main:
            print(f"distlm: error: {exc}", file=sys.stderr, flush=True)
        return 1
    except (DistributedInitError, CollectiveFailure, ReplicaDrift) as exc:
        # Start-up and collective failures already carry a one-line explanation naming
        # the ranks; every rank prints its own, since each may see a different peer fail.
        print(f"distlm: error: {exc}", file=sys.stderr, flush=True)
        return 1
    finally:
        shutdown()
    return 0


def run() -> None:
    """``python -m distlm.train`` and the ``distlm-train`` command."""
    exit_without_teardown(main())


if __name__ == "__main__":
    run()
