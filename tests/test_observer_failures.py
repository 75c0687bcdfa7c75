"""Observers never end a run: a failing --log-file, run.json, trace or tracker is one warning and
training goes on; what can be checked at start (--profile-dir, a tracker's server) is refused
there in one line; a tracker's server that refuses or never answers cannot hold the start, and
neither can it hold off SIGTERM.

The tracker servers are sockets of this test: one bound and not listening (every connection is
refused), one listening that never answers (the kernel accepts the connection, nothing replies).
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

from distlm.config import parse_args
from distlm.observe import trackers as trackers_module
from distlm.observe.profiler import ProfileWindow
from distlm.observe.trackers import MLFLOW_REQUEST_SEC, START_FINISH_SEC, Trackers
from distlm.train import main

MLFLOW_CLIENT_VARIABLES = ("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "MLFLOW_HTTP_REQUEST_TIMEOUT")
# Time besides the bound itself: an in-process start (data, model) and its teardown, on 2 cores
# shared with other test processes.
LOAD_SLACK_SEC = 15.0


class _Servers:
    """A refusing and a silent server on this host; ``connected`` is set at the silent one's
    first connection, at ``connected_at``."""

    def __init__(self):
        self.refusing = socket.socket()
        self.refusing.bind(("127.0.0.1", 0))
        self.silent = socket.socket()
        self.silent.bind(("127.0.0.1", 0))
        self.silent.listen(16)
        self.connected = threading.Event()
        self.connected_at = 0.0
        self.held: list[socket.socket] = []
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self):
        try:
            while True:
                connection, _ = self.silent.accept()
                self.held.append(connection)  # kept open, never answered
                if not self.connected.is_set():
                    self.connected_at = time.monotonic()
                    self.connected.set()
        except OSError:
            return  # closed

    def uri(self, which: str) -> str:
        return f"http://127.0.0.1:{getattr(self, which).getsockname()[1]}"

    def close(self):
        for sock in [self.refusing, self.silent, *self.held]:
            sock.close()


@pytest.fixture(scope="module")
def servers():
    servers = _Servers()
    yield servers
    servers.close()


@pytest.fixture()
def mlflow_client_env(monkeypatch):
    """distlm sets MLflow's client variables in its own process when the user has not: they are
    unset for the test and removed after it."""
    for name in MLFLOW_CLIENT_VARIABLES:
        monkeypatch.setenv(name, "")
        monkeypatch.delenv(name)


def tiny_run(data_dir: str, save_dir: Path, *extra: str) -> list[str]:
    return ["--data", data_dir, "--arch", "roberta_tiny", "--tokens-per-sample", "32", "--batch-size", "2",
            "--max-update", "2", "--log-interval", "1", "--log-format", "json", "--device", "cpu",
            "--save-dir", str(save_dir), *extra]


def distlm_warnings(caplog) -> list[str]:
    """distlm's warnings but the straggler statistics', which a loaded machine may call for."""
    return [r.getMessage() for r in caplog.records
            if r.name == "distlm" and r.levelno >= logging.WARNING and r.module != "stragglers"]


@pytest.mark.skipif(not Path("/dev/full").is_char_device(), reason="needs /dev/full")
def test_full_log_disk_unwritable_run_json_and_unreachable_best_effort_tracker_are_warnings(
        data_dir, tmp_path, servers, mlflow_client_env, caplog, capsys):
    # /dev/full takes the open and refuses every write (ENOSPC), as a full disk does.
    (tmp_path / "ck" / "run.json").mkdir(parents=True)
    argv = tiny_run(data_dir, tmp_path / "ck", "--log-file", "/dev/full",
                    "--mlflow-tracking-uri", servers.uri("refusing"), "--tracker-best-effort")
    with caplog.at_level(logging.INFO, logger="distlm"):
        assert main(argv) == 0
    warnings = distlm_warnings(caplog)
    assert len(warnings) == 3, warnings
    # The log file's first write is the start-up's first line.
    assert warnings[0] == "--log-file /dev/full: cannot write (No space left on device); training goes on without it"
    assert warnings[1] == f"{tmp_path / 'ck' / 'run.json'}: not written (Is a directory); training goes on without it"
    assert warnings[2].startswith(f"--mlflow-tracking-uri {servers.uri('refusing')}: mlflow could not start (")
    assert "Connection refused" in warnings[2]
    assert warnings[2].endswith("training goes on without it (--tracker-best-effort)")
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


@pytest.mark.parametrize("which, cause", [("refusing", "Connection refused"), ("silent", "Read timed out")])
def test_unreachable_tracker_is_one_line_within_the_request_timeout(which, cause, data_dir, tmp_path, servers,
                                                                    mlflow_client_env, capsys):
    uri = servers.uri(which)
    started = time.monotonic()
    code = main(tiny_run(data_dir, tmp_path / "ck", "--mlflow-tracking-uri", uri))
    returned = time.monotonic()
    err = [line for line in capsys.readouterr().err.splitlines() if line.startswith("distlm")]
    assert code == 2
    assert len(err) == 1, err
    assert err[0].startswith(f"distlm: error: --mlflow-tracking-uri {uri}: mlflow could not start (")
    assert cause in err[0] and err[0].endswith("check it, or add --tracker-best-effort to train without it")
    if which == "silent":
        # MLflow's own defaults (120 s a try, 7 retries) held this call for many minutes.
        assert returned - servers.connected_at < MLFLOW_REQUEST_SEC + LOAD_SLACK_SEC
    assert returned - started < START_FINISH_SEC
    assert not (tmp_path / "ck" / "checkpoint_last").exists()


def test_sigterm_while_a_tracker_starts_exits_at_once(data_dir, tmp_path, servers):
    # The user's own long MLflow timeout: only the signal can end this start before distlm's bound.
    env = {**os.environ, "OMP_NUM_THREADS": "1", "DISTLM_CACHE_DIR": str(tmp_path / "cache"),
           "MLFLOW_HTTP_REQUEST_TIMEOUT": "120"}
    servers.connected.clear()
    proc = subprocess.Popen([sys.executable, "-m", "distlm.train",
                             *tiny_run(data_dir, tmp_path / "ck", "--mlflow-tracking-uri", servers.uri("silent"))],
                            env=env, cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert servers.connected.wait(120), "the tracker never connected"
        signalled = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        _, stderr = proc.communicate(timeout=60)
        ended = time.monotonic()
    finally:
        proc.kill()
    assert proc.returncode == 128 + signal.SIGTERM
    assert [line for line in stderr.splitlines() if line.startswith("distlm")] == [
        "distlm: SIGTERM before training started; nothing saved"]
    assert "Traceback" not in stderr
    assert ended - signalled < 10.0  # the wait looks for a stop signal every 0.1 s


def test_tracker_thread_failure_is_one_warning_and_no_traceback(tmp_path, monkeypatch, caplog):
    seen: list[str] = []
    monkeypatch.setattr(threading, "excepthook", lambda args: seen.append(args.thread.name))
    config = parse_args(["--tensorboard-logdir", str(tmp_path / "tb")])
    before = set(threading.enumerate())
    with caplog.at_level(logging.WARNING, logger="distlm"):
        trackers = Trackers.open(config, {}, None)
        writer_threads = [t for t in set(threading.enumerate()) - before if not t.name.startswith("distlm-")]
        assert writer_threads  # TensorBoard's event writer
        trackers.log({"update": 1, "loss": 2.0}, "train")
        shutil.rmtree(tmp_path / "tb")  # TensorBoard's writer thread reopens its events file for each record
        for update in range(2, 6):
            trackers.log({"update": update, "loss": 2.0}, "train")
        for thread in writer_threads:
            thread.join(10)
            assert not thread.is_alive()  # ended by its exception
    assert trackers.trackers == []
    messages = [r.getMessage() for r in caplog.records]
    assert len(messages) == 1 and messages[0].startswith("tensorboard failed (FileNotFoundError: "), messages
    assert messages[0].endswith("; training goes on without it")
    assert seen == []  # the writer thread's exception did not reach the hook that prints tracebacks
    other = threading.Thread(target=lambda: 1 / 0, name="not-a-tracker")
    other.start()
    other.join()
    assert seen == ["not-a-tracker"]  # only the trackers' threads are caught
    trackers.close()
    assert threading.excepthook is not trackers._hook and seen == ["not-a-tracker"]


def test_hung_tracker_is_dropped_after_the_log_bound(monkeypatch, caplog):
    release = threading.Event()

    class Hung:
        name, run_id = "hung", None

        def log(self, tags, step):
            release.wait(60)

    monkeypatch.setattr(trackers_module, "LOG_SEC", 0.5)
    trackers = Trackers([Hung()])
    started = time.monotonic()
    with caplog.at_level(logging.WARNING, logger="distlm"):
        trackers.log({"update": 1, "loss": 2.0}, "train")
        trackers.log({"update": 2, "loss": 2.0}, "train")  # dropped: not called again
    release.set()
    assert time.monotonic() - started < 5.0
    assert [r.getMessage() for r in caplog.records] == [
        "hung failed (no answer within 0.5 s); training goes on without it"]
    assert trackers.trackers == []


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
