"""Stop signals: SIGTERM (torchrun, Slurm) and SIGINT (Ctrl-C) stop every rank at one update,
save a checkpoint there, and end with one line; a resume continues from it exactly; a
second signal exits at once.

The reference for "exactly" is an uninterrupted run computed here, in this process.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import torch

from distlm import checkpoint

TIMEOUT = 240
STOP_LINE = re.compile(r"distlm: (SIG\w+): stopped at update (\d+) and saved (\S+); the same command resumes from it")


def args_for(data: str, save_dir: Path, max_update: int) -> list[str]:
    # --total-num-update fixed, so the schedule does not depend on where a run stops.
    return [
        "--data", data, "--arch", "roberta_tiny", "--tokens-per-sample", "32", "--batch-size", "2",
        "--dropout", "0.1", "--lr", "1e-3", "--warmup-updates", "2", "--total-num-update", "50",
        "--max-update", str(max_update), "--log-interval", "1", "--log-format", "json",
        "--save-dir", str(save_dir), "--device", "cpu", "--seed", "4", "--timeout-sec", "60",
    ]


def signal_after_updates(command: list[str], signum: int, updates: int, cwd: Path) -> tuple[int, str]:
    """Start ``command``, send ``signum`` once rank 0 has logged ``updates`` updates; (status, stderr)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "DISTLM_CACHE_DIR": str(cwd / "cache")}
    proc = subprocess.Popen(command, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + TIMEOUT
    try:
        for line in proc.stdout:
            if line.startswith("{") and json.loads(line).get("update", 0) >= updates:
                proc.send_signal(signum)
                break
            assert time.monotonic() < deadline, "no training progress"
        proc.stdout.read()
        return proc.wait(timeout=TIMEOUT), proc.stderr.read()
    finally:
        proc.kill()


def stopped_at(stderr: str, signum: int, save_dir: Path) -> int:
    """The update named by the run's one stop line, checked against the checkpoint it names."""
    lines = [line for line in stderr.splitlines() if line.startswith("distlm:")]
    assert len(lines) == 1, stderr[-4000:]
    match = STOP_LINE.fullmatch(lines[0])
    assert match, lines
    assert match.group(1) == signal.Signals(signum).name
    assert Path(match.group(3)) == save_dir / checkpoint.LAST
    # torchrun prints a traceback of its own when it is signalled; none may come from distlm.
    assert not re.search(r'File ".*/distlm/', stderr), stderr[-4000:]
    return int(match.group(2))


def train(args: list[str], cwd: Path) -> str:
    """A whole ``python -m distlm.train`` run in a process of its own, as the interrupted run
    is: the three runs compared share no state of this test process."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "DISTLM_CACHE_DIR": str(cwd / "cache")}
    done = subprocess.run([sys.executable, "-m", "distlm.train", *args], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=TIMEOUT)
    assert done.returncode == 0, done.stderr[-4000:]
    return done.stdout + done.stderr


def test_ctrl_c_saves_and_a_resume_continues_exactly(data_dir, tmp_path):
    save_dir = tmp_path / "interrupted"
    status, stderr = signal_after_updates(
        [sys.executable, "-m", "distlm.train", *args_for(data_dir, save_dir, 10_000)], signal.SIGINT, 2, tmp_path)
    assert status == 128 + signal.SIGINT, stderr[-4000:]
    stop = stopped_at(stderr, signal.SIGINT, save_dir)
    assert stop >= 2
    assert checkpoint.load(save_dir / checkpoint.LAST)["num_updates"] == stop

    log = train(args_for(data_dir, save_dir, stop + 2), tmp_path)
    assert f"resumed from {save_dir / checkpoint.LAST} at update {stop} " in log, log[-4000:]
    assert "dropout RNG reseeded" not in log, log[-4000:]
    train(args_for(data_dir, tmp_path / "straight", stop + 2), tmp_path)
    straight, resumed = checkpoint.load(tmp_path / "straight" / checkpoint.LAST), checkpoint.load(save_dir / checkpoint.LAST)
    assert straight["num_updates"] == resumed["num_updates"] == stop + 2
    expected, actual = straight["model"], resumed["model"]
    assert actual.keys() == expected.keys()
    for name in expected:
        assert torch.equal(actual[name], expected[name]), name


def test_sigterm_to_torchrun_stops_both_ranks_at_one_update(data_dir, tmp_path):
    """torchrun forwards SIGTERM to both workers; they agree on one update and save there."""
    save_dir = tmp_path / "checkpoints"
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
               "-m", "distlm.train", *args_for(data_dir, save_dir, 10_000)]
    _, stderr = signal_after_updates(command, signal.SIGTERM, 2, tmp_path)
    stop = stopped_at(stderr, signal.SIGTERM, save_dir)
    last = save_dir / checkpoint.LAST
    state = checkpoint.load(last)
    assert state["num_updates"] == stop and state["world_size"] == 2
    assert len(list(last.glob("*.distcp"))) == 2  # both ranks wrote their part of the same save


def test_a_second_signal_exits_at_once(tmp_path):
    """The second SIGTERM is acted on even while the main thread is blocked in a lock."""
    script = ("import threading\nfrom distlm.runtime.signals import StopSignals\nStopSignals().install()\n"
              "print('ready', flush=True)\nlock = threading.Lock()\nlock.acquire()\nlock.acquire()\n")
    proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "ready"
        proc.send_signal(signal.SIGTERM)
        time.sleep(0.2)
        assert proc.poll() is None  # the first one only asks to stop at the next update
        time.sleep(1.0)  # past the window in which a repeat is the same request
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 128 + signal.SIGTERM
        assert proc.stderr.read().strip() == (
            "distlm: SIGTERM again: exiting now, without a checkpoint (the newest complete checkpoint is intact)")
    finally:
        proc.kill()
