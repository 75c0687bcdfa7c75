"""One owner per save dir, under races and pauses: of many runs taking over one stale
lock exactly one wins; a live run's lock is never stale by age on its own host; a run
whose lock was taken over stops before its next save; Slurm job steps are owners apart."""

from __future__ import annotations

import json
import multiprocessing
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from distlm.checkpoint import directory
from distlm.checkpoint.lock import GUARD_FILE, LOCK_FILE, SaveDirLock, _boot_id, _process_start
from distlm.errors import UsageError
from distlm.training.trainer import Trainer
from test_checkpoint_trust import run_main, tiny_args

TAKERS, ROUNDS = 6, 200


def _dead_pid() -> int:
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    return child.pid


def _stale_lock(save_dir: Path, round_: int, dead_pid: int) -> None:
    """A lock every taker judges stale: a dead process of this host, or a silent other host."""
    save_dir.mkdir()
    lock = save_dir / LOCK_FILE
    if round_ % 2:
        lock.write_text(json.dumps({"run": "torchrun gone", "host": socket.gethostname(), "boot": _boot_id(),
                                    "pid": dead_pid, "token": "old"}))
    else:
        lock.write_text(json.dumps({"run": "torchrun gone", "host": "elsewhere", "pid": 1, "token": "old"}))
        os.utime(lock, (time.time() - 3600, time.time() - 3600))


def _take(root: str, barrier, results) -> None:
    held = []  # the winners keep their locks until every round is over
    for round_ in range(ROUNDS):
        barrier.wait()
        lock = SaveDirLock(Path(root) / str(round_))
        try:
            lock.acquire()
            held.append(lock)
            results.put((round_, os.getpid()))
        except UsageError:
            results.put((round_, None))
    barrier.wait()


def test_of_many_runs_taking_over_one_stale_lock_exactly_one_wins(tmp_path):
    dead = _dead_pid()
    for round_ in range(ROUNDS):
        _stale_lock(tmp_path / str(round_), round_, dead)
    context = multiprocessing.get_context("fork")
    barrier, results = context.Barrier(TAKERS), context.Queue()
    takers = [context.Process(target=_take, args=(str(tmp_path), barrier, results)) for _ in range(TAKERS)]
    for taker in takers:
        taker.start()
    outcomes = [results.get(timeout=120) for _ in range(TAKERS * ROUNDS)]
    for taker in takers:
        taker.join(timeout=60)
        assert taker.exitcode == 0
    for round_ in range(ROUNDS):
        winners = [pid for number, pid in outcomes if number == round_ and pid is not None]
        assert len(winners) == 1, f"round {round_}: {len(winners)} runs own one save dir"
        assert json.loads((tmp_path / str(round_) / LOCK_FILE).read_text())["pid"] == winners[0]


@pytest.fixture
def live_holder(tmp_path):
    """Another run of this host holding ``tmp_path/save``'s lock, alive until the test ends."""
    save = tmp_path / "save"
    save.mkdir()
    holder = subprocess.Popen(
        [sys.executable, "-c", "import sys, time; from pathlib import Path; from distlm.checkpoint.lock import "
         "SaveDirLock; SaveDirLock(Path(sys.argv[1])).acquire(); print('held', flush=True); time.sleep(120)",
         str(save)], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        yield save, holder.pid
    finally:
        holder.kill()
        holder.wait()


def test_a_live_runs_lock_on_this_host_is_never_stale_by_age(live_holder):
    save, pid = live_holder
    lock = save / LOCK_FILE
    subprocess.run(["touch", "-d", "1 day ago", str(lock)], check=True)  # a suspended job, a hung mount
    with pytest.raises(UsageError, match=f"belongs to another run \\(process {socket.gethostname()}:{pid}, "):
        SaveDirLock(save).acquire()
    assert json.loads(lock.read_text())["pid"] == pid


def test_a_pid_reused_by_another_process_does_not_keep_a_dead_runs_lock(tmp_path):
    lock = tmp_path / LOCK_FILE
    parent = os.getppid()  # alive, but started at another time than the lock says
    lock.write_text(json.dumps({"run": "process gone", "host": socket.gethostname(), "boot": _boot_id(),
                                "pid": parent, "start": _process_start(parent) + 1, "token": "old"}))
    SaveDirLock(tmp_path).acquire()
    assert json.loads(lock.read_text())["pid"] == os.getpid()


def test_two_steps_of_one_slurm_job_are_two_owners_and_a_requeued_step_is_one(tmp_path, monkeypatch):
    lock = tmp_path / LOCK_FILE
    lock.write_text(json.dumps({"run": "slurm job 7 step 0", "host": "node1", "pid": 99, "token": "old"}))
    monkeypatch.setenv("SLURM_JOB_ID", "7")
    monkeypatch.setenv("SLURM_STEP_ID", "1")
    with pytest.raises(UsageError, match="belongs to another run \\(slurm job 7 step 0, host node1"):
        SaveDirLock(tmp_path).acquire()
    monkeypatch.setenv("SLURM_STEP_ID", "0")  # the same step, requeued onto another node
    SaveDirLock(tmp_path).acquire()
    assert json.loads(lock.read_text())["run"] == "slurm job 7 step 0"


def test_two_live_processes_of_one_job_on_one_host_are_refused(live_holder, monkeypatch):
    save, pid = live_holder
    lock = save / LOCK_FILE
    holder = json.loads(lock.read_text())
    lock.write_text(json.dumps({**holder, "run": "slurm job 7 step batch"}))
    monkeypatch.setenv("SLURM_JOB_ID", "7")  # two runs in one salloc shell: no step of their own
    with pytest.raises(UsageError, match="belongs to another process of this job"):
        SaveDirLock(save).acquire()


@pytest.mark.parametrize("kind", ["symlink", "directory"])
def test_a_lock_that_is_not_a_plain_file_is_named_for_what_it_is(tmp_path, kind):
    lock = tmp_path / LOCK_FILE
    if kind == "symlink":
        lock.symlink_to(tmp_path / "elsewhere")
    else:
        lock.mkdir()
    what = "a symbolic link" if kind == "symlink" else "a directory"
    with pytest.raises(UsageError, match=f"its lock {lock} is {what}, not a lock distlm wrote"):
        SaveDirLock(tmp_path).acquire()


def test_a_run_whose_lock_was_taken_over_stops_before_its_next_save(tmp_path, capsys, monkeypatch):
    save = tmp_path / "save"
    other = {"run": "torchrun other", "host": "elsewhere", "pid": 1, "since": "now", "token": "theirs"}
    original, steps = Trainer.train_step, []

    def step_then_lose_the_lock(self, *args, **kwargs):
        steps.append(len(steps) + 1)
        if len(steps) == 2:  # after checkpoint_1 was saved, another run took the save dir over
            (save / LOCK_FILE).write_text(json.dumps(other))
        return original(self, *args, **kwargs)

    monkeypatch.setattr(Trainer, "train_step", step_then_lose_the_lock)
    code, lines = run_main(tiny_args(save, 3, ["--save-interval-updates", "1"]), capsys)
    assert code == 2 and len(lines) == 1, lines
    assert (f"--save-dir {save} is no longer this run's: its lock {save / LOCK_FILE} was taken over (run torchrun "
            "other, host elsewhere, pid 1, since now holds it now); this run stops without saving") in lines[0]
    assert steps == [1, 2]
    assert directory.is_complete(save / directory.numbered(1)) and not (save / directory.numbered(2)).exists()
    assert json.loads((save / LOCK_FILE).read_text()) == other  # the other run's lock is left alone
    assert not list(save.glob(".incomplete-*"))
