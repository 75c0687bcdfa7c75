"""Ranks launched with different settings or data are refused at start: one line naming the
setting and the ranks holding each value, exit status 2, before any training collective."""

from __future__ import annotations

import contextlib
import io
import os
import shutil
import time
from pathlib import Path

import pytest

from distributed import run_distributed
from distlm.errors import describe_ranks
from distlm.runtime.agreement import find_disagreement, fingerprint_data, shared_settings
from distlm.config import parse_args
from distlm.train import main


def base_args(data: str, save_dir: str) -> list[str]:
    return ["--data", data, "--arch", "roberta_tiny", "--tokens-per-sample", "32", "--batch-size", "2",
            "--max-update", "2", "--save-dir", save_dir, "--device", "cpu", "--timeout-sec", "20"]


@pytest.mark.parametrize("flag, value_0, value_1", [
    ("--lr", "0.001", "0.002"),
    ("--seed", "1", "2"),
    ("--mask-prob", "0.15", "0.2"),
    ("--batch-size", "2", "4"),
    ("--tokens-per-sample", "32", "64"),
    ("--update-freq", "1", "2"),
    ("--arch", "roberta_tiny", "llama_tiny"),
    ("--strategy", "ddp", "fsdp"),
    ("--max-update", "2", "3"),
    ("--save-dir", "a", "b"),
])
def test_the_first_differing_setting_is_named_with_its_ranks(data_dir, flag, value_0, value_1):
    configs = [parse_args(base_args(data_dir, "ck") + [flag, value]) for value in (value_0, value_1, value_0)]
    message = find_disagreement([shared_settings(config) for config in configs])
    assert message is not None and message.startswith(f"the ranks were launched with different {flag}: "), message
    assert message.endswith("; give every rank the same settings and data"), message
    held = message.split(": ", 1)[1]
    assert f"on ranks 0, 2; " in held and held.count("on rank 1;") == 1, message
    assert value_1 in held.split("on ranks 0, 2; ")[1], message
    # Settings that legitimately differ per rank are not compared.
    same = [parse_args(base_args(data_dir, "ck") + ["--num-workers", str(n), "--log-format", fmt])
            for n, fmt in ((0, "json"), (2, "simple"))]
    assert find_disagreement([shared_settings(config) for config in same]) is None


def test_data_is_compared_by_content_not_path(data_dir, tmp_path):
    copy = shutil.copytree(data_dir, tmp_path / "copy")
    assert fingerprint_data(data_dir) == fingerprint_data(str(copy))
    settings = [shared_settings(parse_args(base_args(path, "ck"))) for path in (data_dir, str(copy))]
    assert find_disagreement(settings) is None
    (copy / "dict.txt").write_text((copy / "dict.txt").read_text().replace("w0 1000", "w0 999"))
    settings[1] = shared_settings(parse_args(base_args(str(copy), "ck")))
    message = find_disagreement(settings, [data_dir, str(copy)])
    assert message is not None and message.startswith("the ranks were launched with different --data: "), message
    assert f"{data_dir} (contents " in message and f"{copy} (contents " in message, message


def test_describe_ranks_compresses_runs():
    assert describe_ranks([3]) == "rank 3"
    assert describe_ranks([0, 1, 2, 5, 7, 8]) == "ranks 0-2, 5, 7-8"


def launch_with_rank_1_different(args: list[str], flag: str, value: str) -> tuple[int, str, float]:
    """``distlm.train.main`` with rank 1 given ``flag value`` besides; (status, stderr, seconds)."""
    if os.environ["RANK"] == "1":
        args = args + [flag, value]
    stderr = io.StringIO()
    started = time.monotonic()
    with contextlib.redirect_stderr(stderr):
        status = main(args)
    return status, stderr.getvalue(), time.monotonic() - started


def test_ranks_with_another_strategy_are_refused_before_fsdp(data_dir, tmp_path):
    """Another --strategy on one rank hung in FSDP's and DDP's collectives before this check."""
    args = base_args(data_dir, str(tmp_path / "ck"))
    results = run_distributed(launch_with_rank_1_different, 2, args, "--strategy", "fsdp", timeout=90)
    expected = ("the ranks were launched with different --strategy: \"ddp\" on rank 0; \"fsdp\" on rank 1; "
                "give every rank the same settings and data")
    for rank, (status, stderr, seconds) in enumerate(results):
        assert status == 2, stderr
        lines = [line for line in stderr.splitlines() if line.startswith("distlm:")]
        assert lines == [f"distlm: error: {'' if rank == 0 else 'rank 1: '}{expected}"], stderr
        assert "Traceback" not in stderr
        assert seconds < 30  # a hang bound: the check runs before any training collective
    assert not Path(tmp_path / "ck" / "checkpoint_last").exists()
