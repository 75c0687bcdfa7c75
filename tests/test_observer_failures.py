"""Observers never end a run: a failing --log-file, run.json or trace is one warning and
training goes on; what can be checked at start (--profile-dir) is refused there in one line.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest
import torch

from distlm.observe.profiler import ProfileWindow
from distlm.train import main


def tiny_run(data_dir: str, save_dir: Path, *extra: str) -> list[str]:
    return ["--data", data_dir, "--arch", "roberta_tiny", "--tokens-per-sample", "32", "--batch-size", "2",
            "--max-update", "2", "--log-interval", "1", "--log-format", "json", "--device", "cpu",
            "--save-dir", str(save_dir), *extra]


def distlm_warnings(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "distlm" and r.levelno >= logging.WARNING]


@pytest.mark.skipif(not Path("/dev/full").is_char_device(), reason="needs /dev/full")
def test_full_log_disk_and_unwritable_run_json_are_warnings(data_dir, tmp_path, caplog, capsys):
    # /dev/full takes the open and refuses every write (ENOSPC), as a full disk does.
    (tmp_path / "ck" / "run.json").mkdir(parents=True)
    argv = tiny_run(data_dir, tmp_path / "ck", "--log-file", "/dev/full")
    with caplog.at_level(logging.INFO, logger="distlm"):
        assert main(argv) == 0
    warnings = distlm_warnings(caplog)
    assert len(warnings) == 2, warnings
    assert warnings[0] == f"{tmp_path / 'ck' / 'run.json'}: not written (Is a directory); training goes on without it"
    assert warnings[1] == "--log-file /dev/full: cannot write (No space left on device); training goes on without it"
    assert not any("pictures of this run" in r.getMessage() for r in caplog.records)  # no log file to draw
    out = capsys.readouterr()
    lines = [json.loads(line) for line in out.out.splitlines() if line.startswith("{")]
    assert [line["update"] for line in lines if line["kind"] == "train"] == [1, 2]  # trained on
    assert "Traceback" not in out.err
    assert (tmp_path / "ck" / "checkpoint_last" / "distlm.json").is_file()
    assert not (tmp_path / "ck" / "run.json.partial").exists()


@pytest.mark.parametrize("where", ["under_a_file", "sys"])
def test_unwritable_profile_dir_is_one_line_before_training(where, tmp_path, capsys):
    # Tests run as root, for whom a chmod'ed directory is writable: a path under a regular file
    # cannot be made, and sysfs refuses new files to root too.
    (tmp_path / "file").write_text("")
    directory = tmp_path / "file" / "profiles" if where == "under_a_file" else Path("/sys")
    code = main(["--arch", "roberta_tiny", "--profile-steps", "1:1", "--profile-dir", str(directory),
                 "--save-dir", str(tmp_path / "ck")])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2
    assert len(err) == 1 and err[0].startswith(f"distlm: error: --profile-dir {directory}: cannot write there ("), err
    assert err[0].endswith("); give a writable directory")
    assert not (tmp_path / "ck").exists()  # nothing started


def test_trace_that_cannot_be_written_is_one_warning(tmp_path, caplog):
    (tmp_path / "file").write_text("")
    directory = tmp_path / "file" / "profiles"  # became unwritable after the start's check
    window = ProfileWindow((1, 1), directory, 0, "cpu", memory_snapshot=False)
    with caplog.at_level(logging.INFO, logger="distlm"):
        with window.update(1):
            torch.ones(8, 8) @ torch.ones(8, 8)
    warnings = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert warnings == [f"profile of updates 1-1: {directory / 'rank0.json'} not written (Not a directory); "
                        "training goes on without it"]
    assert any("top operators by self time" in r.getMessage() and "aten::mm" in r.getMessage()
               for r in caplog.records)  # the summary is still logged
