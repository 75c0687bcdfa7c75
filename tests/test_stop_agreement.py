"""A stop signal that reaches one rank of a tensor- or pipeline-parallel layout stops every
rank at the same update: the flags ride in the update's one world all-reduce (with the
target count), whichever group the data-parallel ranks form."""

from __future__ import annotations

import signal

import pytest

from distributed import run_distributed
from distlm.config import parse_args
from distlm.trainer import Trainer
from test_ddp import common_args


def agreed_per_update(args: list[str]) -> list[list[int]]:
    """The signals every rank agreed on at each of two updates; rank 1 is signalled between them."""
    trainer = Trainer(parse_args(args))
    batches = trainer.update_batches()
    agreed = []
    for update in range(2):
        if update == 1 and trainer.ctx.rank == 1:
            trainer.stop._record(signal.SIGTERM)  # as the watcher thread records a delivered signal
        trainer.train_step(next(batches))
        agreed.append(list(trainer.stop.agreed))
    return agreed


@pytest.mark.parametrize("layout", [["--tp-degree", "2"], ["--pp-degree", "2"]], ids=["tp2", "pp2"])
def test_a_signal_on_one_rank_stops_every_rank_of_a_model_parallel_layout(data_dir, tmp_path, layout):
    args = common_args(data_dir, str(tmp_path / "none"), "llama_tiny") + [
        "--tokens-per-sample", "16", "--batch-size", "4", *layout]
    for agreed in run_distributed(agreed_per_update, 2, args, timeout=240):
        assert agreed == [[], [signal.SIGTERM]]
