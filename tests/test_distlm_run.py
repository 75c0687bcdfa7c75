"""``distlm-run`` (torchrun ending in distlm's one line) and the refusals made before a run
starts: a mistyped flag (with the nearest known one, without importing torch) and bad
``--data`` (before the save dir is created or locked).

The launches are real: ``python -m distlm.run`` starting 2 gloo workers of ``distlm.train``.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from torch.distributed.elastic.multiprocessing.errors import ProcessFailure

from distlm import checkpoint
from distlm.checkpoint.lock import LOCK_FILE
from distlm.config import parse_args
from distlm.errors import LAST_LINE_DIR, UsageError, print_last_line
from distlm.run import describe_failure, describe_stop, read_last_lines
from distlm.train import main
from test_signals import args_for as signal_args, signal_after_updates, stopped_at

TIMEOUT = 240
MISTYPED = "distlm: error: unrecognized arguments: --max-updat (did you mean --max-update?)"


def launch(*argv: str) -> list[str]:
    return [sys.executable, "-m", "distlm.run", "--standalone", "--nproc_per_node", "2", *argv]


# ------------------------------------------------------------------ distlm-run


def test_a_usage_error_under_distlm_run_is_one_line_and_status_2(tmp_path):
    """Both workers meet the mistyped flag; rank 0's line is the only line, with no torchrun
    banner, log record or traceback, and the launcher exits with the worker's status."""
    proc = subprocess.run(launch("-m", "distlm.train", "--max-updat", "3"), cwd=tmp_path, capture_output=True,
                          text=True, timeout=TIMEOUT, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 2, proc.stderr[-4000:]
    assert proc.stderr.splitlines() == [MISTYPED], proc.stderr[-4000:]


def test_sigterm_under_distlm_run_saves_and_ends_in_one_line(data_dir, tmp_path):
    save_dir = tmp_path / "checkpoints"
    status, stderr = signal_after_updates(launch("-m", "distlm.train", *signal_args(data_dir, save_dir, 10_000)),
                                          signal.SIGTERM, 1, tmp_path)
    assert status == 128 + signal.SIGTERM, stderr[-4000:]
    stop = stopped_at(stderr, signal.SIGTERM, save_dir)  # the one distlm line, naming the checkpoint
    assert stderr.splitlines()[-1].startswith("distlm: SIGTERM: stopped at update")
    assert "Traceback" not in stderr and "death signal" not in stderr, stderr[-4000:]
    state = checkpoint.load(save_dir / checkpoint.LAST)
    assert state["num_updates"] == stop >= 1 and state["world_size"] == 2


def failure(exitcode: int, pid: int, tmp_path: Path) -> ProcessFailure:
    return ProcessFailure(local_rank=0, pid=pid, exitcode=exitcode, error_file=str(tmp_path / "no-error-file"))


def test_the_first_failing_workers_own_line_is_chosen(tmp_path, monkeypatch):
    """Lines are matched to the failed workers by process id: an earlier attempt's line is not
    taken, and of the failed workers' lines the first written wins."""
    monkeypatch.setenv(LAST_LINE_DIR, str(tmp_path))
    print_last_line("distlm: error: an earlier attempt's line", 2, 0)  # written by this process's pid
    records = read_last_lines(str(tmp_path))
    assert [(r["line"], r["status"], r["pid"]) for r in records] == [("distlm: error: an earlier attempt's line", 2,
                                                                      os.getpid())]
    # Above Linux's highest pid (2**22), so that no real process is taken for them.
    first, second = 2**22 + 1, 2**22 + 2
    later = [{**records[0], "pid": second, "ppid": 1, "rank": 1, "line": "rank 1's", "status": 1,
              "time": records[0]["time"] + 2},
             {**records[0], "pid": first, "ppid": 1, "rank": 0, "line": "rank 0's", "status": 2,
              "time": records[0]["time"] + 1}]
    failures = {0: failure(2, first, tmp_path), 1: failure(1, second, tmp_path)}
    assert describe_failure(failures, records + later) == ("rank 0's", 2)


def test_a_worker_without_a_line_is_named_with_its_status(tmp_path):
    """Rank 1 died on its own; rank 0 was ended by torchrun's SIGTERM afterwards."""
    failures = {0: failure(-signal.SIGTERM, 100, tmp_path), 1: failure(1, 101, tmp_path)}
    line, status = describe_failure(failures, [])
    assert status == 1 and line.startswith("distlm: error: rank 1 (pid 101) exited with status 1 without"), line
    line, status = describe_failure({3: failure(-signal.SIGKILL, 7, tmp_path)}, [])
    assert status == 128 + signal.SIGKILL and "rank 3 (pid 7) was killed by SIGKILL" in line, line
    line, status = describe_stop(signal.SIGINT, [])
    assert status == 128 + signal.SIGINT and line.startswith("distlm: SIGINT: the workers ended before"), line


# ------------------------------------------------------------ early refusals


def test_a_mistyped_flag_names_the_nearest_one_without_importing_torch():
    """Refusals of a flag, an arch name, a value's range and a flag of another model family all
    come before torch, the models' code or the data are imported: the model families' torch-free
    records (distlm/models/family.py) answer the arch and flag checks."""
    code = ("import sys\nfrom distlm.train import main\nstatus = main(sys.argv[1:])\n"
            "model_code = ('model', 'parts', 'hf', 'loss', 'flops', 'contract')\n"
            "heavy = sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'numpy')\n"
            "               or m.startswith(('distlm.models.hf', 'distlm.data', 'distlm.training.trainer'))\n"
            "               or m.startswith('distlm.models.') and m.rsplit('.', 1)[1] in model_code)\n"
            "print(status, heavy)")
    refusals = (
        (["--max-updat", "3"], "unrecognized arguments: --max-updat (did you mean --max-update?)"),
        (["--arch", "robrta_base"], "--arch robrta_base is unknown; choose one of: roberta_tiny"),
        (["--lr", "-1"], "--lr must be in (0"),
        (["--arch", "llama_tiny", "--encoder-layers", "2"], "--encoder-layers sizes a roberta model, but --arch "
                                                             "llama_tiny is a llama model"),
        (["--lr=fast"], "--lr: cannot parse 'fast' as a number"),
    )
    for argv, line in refusals:
        proc = subprocess.run([sys.executable, "-c", code, *argv], capture_output=True, text=True, timeout=TIMEOUT)
        assert proc.stdout.split() == ["2", "[]"], proc.stdout + proc.stderr
        assert proc.stderr.strip().startswith(f"distlm: error: {line}"), proc.stderr


def test_unknown_settings_suggest_the_nearest_known_one(tmp_path):
    with pytest.raises(UsageError, match=r"unrecognized arguments: --warmup-update=4 \(did you mean "
                                         r"--warmup-updates\?\) --nothing-like-it$"):
        parse_args(["--warmup-update=4", "--nothing-like-it"])
    toml = tmp_path / "run.toml"
    toml.write_text("[optim]\nmax_updates = 3\n")
    with pytest.raises(UsageError, match=r"unknown setting 'max_updates' in \[optim\] \(did you mean max_update\?\)"):
        parse_args(["--config", str(toml)])


def test_bad_data_leaves_no_save_dir_and_no_lock(data_dir, tmp_path, capsys):
    """A --data that is not there, and one without the valid split (read after the train
    split), are refused before the save dir is made; an existing save dir gets no lock."""
    no_valid = tmp_path / "no_valid"
    no_valid.mkdir()
    for name in ("dict.txt", "train.bin", "train.idx"):
        shutil.copy(Path(data_dir) / name, no_valid / name)
    existing = tmp_path / "existing"
    existing.mkdir()
    for data, save_dir, named in ((tmp_path / "absent", tmp_path / "new", "is not a directory"),
                                  (no_valid, tmp_path / "new", "no valid.idx"),
                                  (no_valid, existing, "no valid.idx")):
        assert main(["--data", str(data), "--save-dir", str(save_dir), "--max-update", "1", "--device", "cpu"]) == 2
        lines = capsys.readouterr().err.splitlines()
        assert lines[-1].startswith(f"distlm: error: data path {data}") and named in lines[-1], lines
        assert not (tmp_path / "new").exists()
        assert list(existing.iterdir()) == [], f"{LOCK_FILE} or more left in an existing save dir"


def test_resuming_onto_another_dictionary_is_refused_naming_it(data_dir, tmp_path, capsys):
    """The checkpoint's symbols are checked against the data once the checkpoint is found,
    which is now after the data was read."""
    base = ["--save-dir", str(tmp_path / "save"), "--device", "cpu", "--tokens-per-sample", "32",
            "--batch-size", "2", "--log-interval", "1000", "--disable-validation"]
    assert main(["--data", data_dir, "--max-update", "1", *base]) == 0
    renamed = tmp_path / "renamed"
    shutil.copytree(data_dir, renamed)
    symbols = (renamed / "dict.txt").read_text().replace("w3 ", "x3 ")
    (renamed / "dict.txt").write_text(symbols)
    capsys.readouterr()
    assert main(["--data", str(renamed), "--max-update", "2", *base]) == 2
    line = capsys.readouterr().err.splitlines()[-1]
    assert line == (f"distlm: error: the given dictionary differs from {renamed / 'dict.txt'} at index 7 "
                    "('w3' vs 'x3'); resume with the data the checkpoint was trained on"), line


def test_last_lines_are_printed_where_no_launcher_reads_them(tmp_path, monkeypatch, capsys):
    """Without distlm-run, or with its directory gone, the line is printed, never lost."""
    print_last_line("distlm: error: plain", 2, 0)
    monkeypatch.setenv(LAST_LINE_DIR, str(tmp_path / "gone"))
    print_last_line("distlm: error: directory gone", 2, 0)
    assert capsys.readouterr().err.splitlines() == ["distlm: error: plain", "distlm: error: directory gone"]
