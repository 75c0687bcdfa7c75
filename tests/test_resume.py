"""Exact resume: 10 updates straight equal 5, a stop, a resume and 5 more, bit for bit.

Dropout is on, so this also proves that every rank's RNG state, the data position and
the optimizer and scheduler state are restored exactly.
"""

from __future__ import annotations

from pathlib import Path

import torch

from distributed import run_distributed
from distlm import checkpoint
from distlm.config import parse_args
from distlm.trainer import Trainer


def fit(args: list[str]) -> None:
    Trainer(parse_args(args)).fit()


def args_for(data: str, save_dir: Path, max_update: int, extra: list[str] = ()) -> list[str]:
    return [
        "--data", data, "--arch", "roberta_tiny", "--tokens-per-sample", "32", "--batch-size", "4",
        "--dropout", "0.1", "--lr", "1e-3", "--warmup-updates", "3", "--total-num-update", "10",
        "--max-update", str(max_update), "--log-interval", "1000", "--save-dir", str(save_dir),
        "--device", "cpu", "--seed", "5", *extra,
    ]


def final_state(save_dir: Path) -> dict:
    return checkpoint.load(save_dir / checkpoint.LAST)


def assert_identical(a: dict, b: dict) -> None:
    assert a["num_updates"] == b["num_updates"]
    assert a["consumed_samples"] == b["consumed_samples"]
    for name, value in a["model"].items():
        assert torch.equal(value, b["model"][name]), name
    for key, state in a["optimizer"]["state"].items():
        for field, value in state.items():
            assert torch.equal(value, b["optimizer"]["state"][key][field]), (key, field)


def test_resume_is_exact_single_process(data_dir, tmp_path):
    fit(args_for(data_dir, tmp_path / "straight", 10))
    fit(args_for(data_dir, tmp_path / "stopped", 5))
    assert final_state(tmp_path / "stopped")["num_updates"] == 5
    fit(args_for(data_dir, tmp_path / "stopped", 10))
    assert_identical(final_state(tmp_path / "stopped"), final_state(tmp_path / "straight"))


def test_resume_is_exact_with_ddp_and_accumulation(data_dir, tmp_path):
    extra = ["--update-freq", "2", "--save-interval-updates", "5"]
    run_distributed(fit, 2, args_for(data_dir, tmp_path / "straight", 10, extra))
    run_distributed(fit, 2, args_for(data_dir, tmp_path / "stopped", 5, extra))
    run_distributed(fit, 2, args_for(data_dir, tmp_path / "stopped", 10, extra))
    assert_identical(final_state(tmp_path / "stopped"), final_state(tmp_path / "straight"))
    # The numbered checkpoint of update 5 is the one the resume started from.
    assert checkpoint.load(tmp_path / "straight" / checkpoint.numbered(5))["num_updates"] == 5
