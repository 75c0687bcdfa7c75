"""What a resume checks and says: data replaced under the same --data path is noticed (the
checkpoint keeps each data file's fingerprint; a resume onto other contents is refused in
one line, or starts the data afresh with --reset-dataloader), and every changed setting
that changes the run is named, with where the learning-rate schedule moves."""

from __future__ import annotations

import json
import logging
import shutil

import numpy as np

from distlm.runtime.agreement import data_files
from distlm.checkpoint.compare import changed_settings
from distlm.config import parse_args
from distlm.checkpoint import directory
from distlm.data.indexed_dataset import write_indexed_dataset
from test_checkpoint import fit
from test_checkpoint_trust import DATA, run_main, tiny_args


def test_data_changed_in_place_is_refused_at_resume_and_accepted_with_reset_dataloader(tmp_path, capsys, caplog):
    data, save = tmp_path / "data", tmp_path / "save"
    shutil.copytree(DATA, data)
    fit(tiny_args(save, 1, ["--data", str(data)]))
    saved = json.loads((save / directory.LAST / directory.META_FILE).read_text())
    assert saved["data_files"] == data_files(str(data))

    # `prepare` run again on other text, into the same directory.
    rng = np.random.default_rng(1)
    write_indexed_dataset(str(data / "train"), [np.append(rng.integers(4, 16, size=12), 2) for _ in range(30)],
                          np.uint16)
    code, lines = run_main(tiny_args(save, 2, ["--data", str(data)]), capsys)
    assert code == 2 and len(lines) == 1, lines
    assert (f"--data {data}: train.bin changed ({saved['data_files']['train.bin']} then, "
            f"{data_files(str(data))['train.bin']} now) since {save / directory.LAST} was saved, so its data position "
            "(2 samples consumed) would read other text; add --reset-dataloader") in lines[0], lines

    with caplog.at_level(logging.INFO, logger="distlm"):
        summary = fit(tiny_args(save, 2, ["--data", str(data), "--reset-dataloader"]), resumes_at=1)
    assert summary["consumed_samples"] == 2  # one update of 2 samples, from the beginning of the new data
    assert any("train.bin changed" in r.getMessage() and "--reset-dataloader: the data starts from its beginning"
               in r.getMessage() for r in caplog.records)


def test_a_resume_names_changed_stop_strategy_and_schedule_and_where_the_lr_moves(tmp_path):
    cosine = ["--arch", "llama_tiny", "--lr", "1e-3", "--warmup-updates", "1", "--lr-scheduler", "cosine"]
    saved = parse_args([*cosine, "--max-update", "10"]).to_dict()
    now = parse_args([*cosine, "--max-update", "14", "--strategy", "fsdp", "--bf16", "--timeout-sec", "60"]).to_dict()
    line = changed_settings(saved, now, saved_dp=1, dp=1, consumed_samples=20, updates=10)
    # The cosine schedule ended at update 10 (lr 0); with --max-update 14 update 11 is back up at
    # 1e-3 * (1 + cos(pi * 10 / 13)) / 2.
    assert line == ("resuming with max-update 10 → 14, bf16 False → True, strategy ddp → fsdp, the learning-rate "
                    "schedule moves: update 11 gets lr 0.0001257, the saved schedule's 0"), line
    assert changed_settings(saved, saved, saved_dp=1, dp=1, consumed_samples=20, updates=10) is None
