"""A stop signal that reaches one rank of a tensor- or pipeline-parallel layout stops every
rank at the same update: the flags ride in the update's one world all-reduce (with the
target count), whichever group the data-parallel ranks form. The same runs show what a
model-parallel start says and warns: the pipeline's start-up line counts the whole model
and each stage, and distlm's own code raises no warning."""

from __future__ import annotations

import logging
import signal
import warnings
from pathlib import Path

import pytest

from distributed import Scenarios
from distlm.config import parse_args
from distlm.models.flops import count_parameters
from distlm.state.names import unwrap
from distlm.training.trainer import Trainer
from test_ddp import common_args

DISTLM = str(Path(__file__).resolve().parents[1] / "distlm")
LAYOUTS = {"tp2": ["--tp-degree", "2"], "pp2": ["--pp-degree", "2"]}


def agreed_per_update(args: list[str]) -> dict:
    """The signals every rank agreed on at each of two updates (rank 1 is signalled between
    them), the start-up's model line, and the warnings raised from distlm's own files."""
    lines: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: lines.append(record.getMessage())
    logger = logging.getLogger("distlm")
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    with warnings.catch_warnings(record=True) as raised:
        warnings.simplefilter("always")
        trainer = Trainer(parse_args(args))
        batches = trainer.update_batches()
        agreed = []
        for update in range(2):
            if update == 1 and trainer.ctx.rank == 1:
                trainer.stop._record(signal.SIGTERM)  # as the watcher thread records a delivered signal
            trainer.train_step(next(batches))
            agreed.append(list(trainer.stop.agreed))
    logger.removeHandler(handler)
    return {"agreed": agreed, "model_line": next((line for line in lines if line.startswith("model: ")), None),
            "whole": count_parameters(unwrap(trainer.model).config),
            "held": sum(p.numel() for p in trainer.model.parameters()),
            "warnings": [f"{w.filename}:{w.lineno}: {w.message}" for w in raised if w.filename.startswith(DISTLM)]}


@pytest.fixture(scope="module")
def runs(data_dir, tmp_path_factory):
    args = common_args(data_dir, str(tmp_path_factory.mktemp("none")), "llama_tiny") + [
        "--tokens-per-sample", "16", "--batch-size", "4"]
    return Scenarios(2, [(name, agreed_per_update, (args + layout,)) for name, layout in LAYOUTS.items()],
                     timeout=300)


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_a_signal_on_one_rank_stops_every_rank_of_a_model_parallel_layout(runs, layout):
    for rank in runs[layout]:
        assert rank["agreed"] == [[], [signal.SIGTERM]]


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_distlm_raises_no_warning_of_its_own_under_model_parallelism(runs, layout):
    for rank in runs[layout]:
        assert rank["warnings"] == []


def test_the_pipeline_start_line_counts_the_whole_model_and_each_stage(runs):
    first, second = runs["pp2"]
    stages = f"{first['held']:,}, {second['held']:,}"
    assert first["model_line"].startswith(f"model: {first['whole']:,} parameters, in 2 pipeline stages of {stages} "
                                          "parameters; "), first["model_line"]
    assert first["whole"] == first["held"] + second["held"]  # llama_tiny ties nothing across the stages
