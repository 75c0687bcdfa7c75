"""A collective that cannot complete fails within --timeout-sec, naming the ranks; never a hang."""

from __future__ import annotations

import time

import pytest

from distributed import run_distributed
from distlm.config import parse_args
from distlm.distributed import CollectiveFailure
from distlm.trainer import Trainer
from test_ddp import common_args, data_dir  # noqa: F401 - shared fixture

TIMEOUT_SEC = 3


def one_rank_stalls(args: list[str]) -> str:
    """Rank 1 stalls past the timeout instead of joining update 1; rank 0 must give up, not hang."""
    trainer = Trainer(parse_args(args))
    batches = trainer.update_batches()
    if trainer.ctx.rank == 1:
        # Long after rank 0's timeout: rank 0 must fail on the timeout, not on this rank leaving.
        time.sleep(5 * TIMEOUT_SEC)
        return "stalled"
    started = time.monotonic()
    with pytest.raises(CollectiveFailure) as failure:
        with trainer.ctx.naming_failed_collectives(1):
            trainer.train_step(next(batches))
    return f"{time.monotonic() - started:.1f}|{failure.value}"


def test_stalled_rank_gives_a_timeout_naming_the_ranks(data_dir, tmp_path):
    args = common_args(data_dir, str(tmp_path)) + ["--batch-size", "2", "--timeout-sec", str(TIMEOUT_SEC)]
    results = run_distributed(one_rank_stalls, 2, args, timeout=90)
    elapsed, message = results[0].split("|", 1)
    assert "among ranks [0, 1]" in message and "--timeout-sec 3" in message, message
    assert "update 1" in message
    # The cause torch reported is the timeout itself, not the stalled rank leaving.
    assert "timed out" in message.split("): ", 1)[1].lower(), message
