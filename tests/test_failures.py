"""A collective that cannot complete fails within --timeout-sec, naming the ranks it waits
for and how far each got; never a hang."""

from __future__ import annotations

import os
import signal
import time

import pytest

from distributed import run_distributed
from distlm.config import parse_args
from distlm.distributed import CollectiveFailure
from distlm.trainer import Trainer
from test_ddp import common_args

TIMEOUT_SEC = 3


def one_rank_stalls(args: list[str]) -> str:
    """Rank 1 stalls past the timeout instead of joining update 1; rank 0 must give up, not hang."""
    trainer = Trainer(parse_args(args))
    batches = trainer.update_batches()
    if trainer.ctx.rank == 1:
        # Long after rank 0's timeout: rank 0 must fail on the timeout, not on this rank leaving.
        time.sleep(5 * TIMEOUT_SEC)
        return "stalled"
    with pytest.raises(CollectiveFailure) as failure:
        with trainer.ctx.naming_failed_collectives(1):
            trainer.train_step(next(batches))
    return str(failure.value)


def test_a_late_rank_is_named(data_dir, tmp_path):
    args = common_args(data_dir, str(tmp_path)) + ["--batch-size", "2", "--timeout-sec", str(TIMEOUT_SEC)]
    message = run_distributed(one_rank_stalls, 2, args, timeout=90)[0]
    assert "rank 0: a collective of update 1 did not complete (--timeout-sec 3)" in message, message
    # Rank 1 is alive (its heartbeat runs) but never started update 1.
    assert "ranks [1] have not started update 1 (rank 1 last completed update 0)" in message, message
    # The cause torch reported is the timeout itself, not the stalled rank leaving.
    assert "timed out" in message.split("Cause: ", 1)[1].lower(), message


def one_rank_is_stopped(args: list[str]) -> str:
    """Both ranks complete update 1; rank 1 is then stopped (SIGSTOP) before update 2's
    first collective, in the same update as rank 0; rank 0 names it and lets it go on."""
    trainer = Trainer(parse_args(args))
    batches = trainer.update_batches()
    pids = trainer.ctx.all_gather_object(os.getpid())
    with trainer.ctx.naming_failed_collectives(1):
        trainer.train_step(next(batches))
    if trainer.ctx.rank == 1:
        time.sleep(TIMEOUT_SEC / 3)  # a few heartbeats: update 1 is published as completed
        os.kill(os.getpid(), signal.SIGSTOP)
        # Continued by rank 0, which has left: this rank's own collective times out now.
        with pytest.raises(CollectiveFailure):
            with trainer.ctx.naming_failed_collectives(2):
                trainer.train_step(next(batches))
        return "continued"
    with pytest.raises(CollectiveFailure) as failure:
        with trainer.ctx.naming_failed_collectives(2):
            trainer.train_step(next(batches))
    os.kill(pids[1], signal.SIGCONT)
    return str(failure.value)


def test_a_stopped_rank_is_named_even_in_the_same_update(data_dir, tmp_path):
    args = common_args(data_dir, str(tmp_path)) + ["--batch-size", "2", "--timeout-sec", str(TIMEOUT_SEC)]
    message = run_distributed(one_rank_is_stopped, 2, args, timeout=90)[0]
    assert "a collective of update 2 did not complete" in message, message
    assert "ranks [1] stopped responding (rank 1 last completed update 1)" in message, message
