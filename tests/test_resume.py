"""Exact resume: 10 updates straight equal 5, a stop, a resume and 5 more, bit for bit.

Dropout is on, so this also proves that every rank's RNG state, the data position and
the optimizer and scheduler state are restored exactly. Each resumed run is checked to
have resumed (at the saved update): one that silently started afresh with the same seed
would otherwise reach the same weights.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from distributed import Scenarios
from distlm import checkpoint
from distlm.config import parse_args
from distlm.training.trainer import Trainer


def fit(args: list[str]) -> int | None:
    """Train; return the update the run resumed at (None: a fresh start)."""
    trainer = Trainer(parse_args(args))
    trainer.fit()
    return trainer.resumed_at


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
    assert fit(args_for(data_dir, tmp_path / "straight", 10)) is None
    assert fit(args_for(data_dir, tmp_path / "stopped", 5)) is None
    assert final_state(tmp_path / "stopped")["num_updates"] == 5
    assert fit(args_for(data_dir, tmp_path / "stopped", 10)) == 5
    assert_identical(final_state(tmp_path / "stopped"), final_state(tmp_path / "straight"))


def fit_counting_whole_models(runs: list[list[str]]) -> list[dict]:
    """``fit`` each run; also count, per run on this rank, the whole models initialised
    from the seed and the materialisations and broadcasts of rank 0's weights."""
    import distlm.training.builder
    import distlm.parallel.api

    calls: dict[str, int] = {}

    def counted(module, name):
        original = getattr(module, name)

        def call(*args, **kwargs):
            calls[name] = calls.get(name, 0) + 1
            return original(*args, **kwargs)

        setattr(module, name, call)

    counted(distlm.training.builder, "_initialised")
    counted(distlm.parallel.api, "materialise")
    counted(distlm.parallel.api, "broadcast_from_rank0")
    results = []
    for args in runs:
        calls.clear()
        results.append({"resumed_at": fit(args), **calls})
    return results


DDP_EXTRA = ["--update-freq", "2", "--save-interval-updates", "5"]
FSDP_EXTRA = ["--strategy", "fsdp", "--disable-validation"]


@pytest.fixture(scope="module")
def two_rank_runs(data_dir, tmp_path_factory) -> tuple[Path, Scenarios]:
    """One 2-rank job for the module (starting 2 processes and torch costs more than these
    runs): straight, stopped and resumed, under DDP with accumulation, then under FSDP."""
    root = tmp_path_factory.mktemp("resume")
    runs = {
        "ddp": [args_for(data_dir, root / "ddp" / "straight", 10, DDP_EXTRA),
                args_for(data_dir, root / "ddp" / "stopped", 5, DDP_EXTRA),
                args_for(data_dir, root / "ddp" / "stopped", 10, DDP_EXTRA)],
        "fsdp": [args_for(data_dir, root / "fsdp" / "straight", 4, FSDP_EXTRA),
                 args_for(data_dir, root / "fsdp" / "stopped", 2, FSDP_EXTRA),
                 args_for(data_dir, root / "fsdp" / "stopped", 4, FSDP_EXTRA)],
    }
    return root, Scenarios(2, [(name, fit_counting_whole_models, (part,)) for name, part in runs.items()], timeout=300)


def test_resume_is_exact_with_ddp_and_accumulation(two_rank_runs):
    root, ranks = two_rank_runs
    assert [[run["resumed_at"] for run in rank] for rank in ranks["ddp"]] == [[None, None, 5]] * 2
    assert_identical(final_state(root / "ddp" / "stopped"), final_state(root / "ddp" / "straight"))
    # The numbered checkpoint of update 5 is the one the resume started from.
    assert checkpoint.load(root / "ddp" / "straight" / checkpoint.numbered(5))["num_updates"] == 5


def test_fsdp_resume_builds_no_whole_model_and_is_exact(two_rank_runs):
    """Under fsdp on 2 ranks a fresh run initialises the whole model on rank 0 only and
    hands each rank its shards; a resumed one allocates only its own shards for the
    checkpoint to fill (no rank builds or receives a whole model), and still continues
    bit for bit."""
    root, ranks = two_rank_runs
    fresh = {"resumed_at": None, "materialise": 1}
    assert [rank[:2] for rank in ranks["fsdp"]] == [[{**fresh, "_initialised": 1}] * 2, [fresh] * 2]
    assert [rank[2] for rank in ranks["fsdp"]] == [{"resumed_at": 2}] * 2
    assert_identical(final_state(root / "fsdp" / "stopped"), final_state(root / "fsdp" / "straight"))
