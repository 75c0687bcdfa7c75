"""A collective that cannot complete fails within --timeout-sec, naming the ranks it waits
for and how far each got; never a hang."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch.distributed as dist
from torch.distributed.checkpoint.filesystem import FileSystemWriter

from distributed import run_distributed
from distlm.config import parse_args
from distlm.runtime.context import CollectiveFailure
from distlm.launch.hosts import find_free_port
from distlm.runtime.heartbeat import Heartbeat, describe_missing
from distlm.errors import exit_without_teardown
from distlm.train import main
from distlm.training.trainer import Trainer
from test_ddp import common_args

TIMEOUT_SEC = 3
DIED = 9  # the exit status of a rank made to die


def one_rank_stalls(args: list[str], rank_0_gave_up: str) -> str:
    """Rank 1 stalls past the timeout instead of joining update 1; rank 0 must give up, not hang."""
    trainer = Trainer(parse_args(args))
    batches = trainer.update_batches()
    if trainer.ctx.rank == 1:
        # Until rank 0 has failed (60 s at most): rank 0 must fail on the timeout, not on this
        # rank leaving, and waiting for its word instead of a fixed sleep ends the test at once.
        deadline = time.monotonic() + 60
        while not os.path.exists(rank_0_gave_up) and time.monotonic() < deadline:
            time.sleep(0.1)
        return "stalled" if os.path.exists(rank_0_gave_up) else "rank 0 did not give up within 60 s"
    try:
        with pytest.raises(CollectiveFailure) as failure:
            with trainer.ctx.naming_failed_collectives(1):
                trainer.train_step(next(batches))
    finally:
        Path(rank_0_gave_up).touch()
    return str(failure.value)


def test_a_late_rank_is_named(data_dir, tmp_path):
    args = common_args(data_dir, str(tmp_path)) + ["--batch-size", "2", "--timeout-sec", str(TIMEOUT_SEC)]
    message, stalled = run_distributed(one_rank_stalls, 2, args, str(tmp_path / "rank_0_gave_up"), timeout=90)
    assert stalled == "stalled"
    assert "rank 0: a collective of update 1 did not complete (--timeout-sec 3)" in message, message
    # Rank 1 is alive (its heartbeat runs) but never started update 1.
    assert "ranks [1] have not started update 1 (rank 1 last completed update 0)" in message, message
    # The cause torch reported is the timeout itself, not the stalled rank leaving.
    assert "timed out" in message.split("Cause: ", 1)[1].lower(), message


def a_rank_is_stopped(args: list[str], stopped: int, store_port: int | None = None) -> str:
    """Both ranks complete update 1; rank ``stopped`` is then stopped (SIGSTOP) before update
    2's first collective, in the same update as the other rank, which names it and lets it
    go on. With ``store_port`` the launch is Kubeflow-style env://, where rank 0 itself
    serves the store."""
    if store_port is not None:
        as_one_process_per_host(store_port)
    trainer = Trainer(parse_args(args))
    assert trainer.ctx.env.launcher == ("env" if store_port is not None else "torchelastic")
    batches = trainer.update_batches()
    pids = trainer.ctx.all_gather_object(os.getpid())
    with trainer.ctx.naming_failed_collectives(1):
        trainer.train_step(next(batches))
    if trainer.ctx.rank == stopped:
        time.sleep(TIMEOUT_SEC / 3)  # a few heartbeats: update 1 is published as completed
        os.kill(os.getpid(), signal.SIGSTOP)
        # Continued by the other rank once it has given up: this rank's own collective fails now.
        with pytest.raises(CollectiveFailure):
            with trainer.ctx.naming_failed_collectives(2):
                trainer.train_step(next(batches))
        return "continued"
    with pytest.raises(CollectiveFailure) as failure:
        with trainer.ctx.naming_failed_collectives(2):
            trainer.train_step(next(batches))
    os.kill(pids[stopped], signal.SIGCONT)
    return str(failure.value)


def test_a_stopped_rank_is_named_even_in_the_same_update(data_dir, tmp_path):
    args = common_args(data_dir, str(tmp_path)) + ["--batch-size", "2", "--timeout-sec", str(TIMEOUT_SEC)]
    message = run_distributed(a_rank_is_stopped, 2, args, 1, timeout=90)[0]
    assert "a collective of update 2 did not complete" in message, message
    assert "ranks [1] stopped responding (rank 1 last completed update 1)" in message, message


def as_one_process_per_host(port: int) -> None:
    """Turn the harness's torchrun-style worker into a Kubeflow-style env:// launch (RANK,
    WORLD_SIZE, MASTER_ADDR, MASTER_PORT only), where rank 0 itself serves the store."""
    for name in ("LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "TORCHELASTIC_RUN_ID",
                 "TORCHELASTIC_USE_AGENT_STORE", "TORCHELASTIC_RESTART_COUNT"):
        os.environ.pop(name, None)
    os.environ["MASTER_PORT"] = str(port)


def test_a_stopped_rank_0_that_serves_the_store_is_named(data_dir, tmp_path):
    # Rank 0 serves the store here, so the port is taken from binding port 0 and releasing
    # it (another process could grab it in between), as for the explicit launch in test_launch.py.
    args = common_args(data_dir, str(tmp_path)) + ["--batch-size", "2", "--timeout-sec", str(TIMEOUT_SEC)]
    started = time.monotonic()
    message = run_distributed(a_rank_is_stopped, 2, args, 0, find_free_port("127.0.0.1"), timeout=90)[1]
    assert "rank 1: a collective of update 2 did not complete" in message, message
    assert "ranks [0] stopped responding (rank 0 serves the rendezvous store" in message, message
    assert "ranks [1] still wait in update 2 (rank 1 last completed update 1)" in message, message
    assert time.monotonic() - started < 60


def train_with_rank_1_dying_in_save(argv: list[str]) -> None:
    """``python -m distlm.train argv``, except that rank 1's process ends inside its first
    checkpoint write, as a killed or crashed node would (no exception, no goodbye)."""
    if os.environ["RANK"] == "1":
        def die(*args, **kwargs):
            os._exit(DIED)

        FileSystemWriter.write_data = die
    exit_without_teardown(main(argv))


def run_two_cli_ranks(function: str, argv: list[str], timeout: float) -> list[subprocess.CompletedProcess]:
    """Two processes running ``function(argv)`` of this module, launched as torchrun launches
    workers (this process serves the store, on a port the OS picked); their exit status and output."""
    store = dist.TCPStore("127.0.0.1", 0, 3, is_master=True, wait_for_workers=False)
    code = f"import sys; sys.path.insert(0, {str(Path(__file__).parent)!r}); import test_failures; " \
           f"test_failures.{function}(sys.argv[1:])"
    procs = []
    for rank in range(2):
        env = {**os.environ, "RANK": str(rank), "WORLD_SIZE": "2", "LOCAL_RANK": str(rank), "LOCAL_WORLD_SIZE": "2",
               "GROUP_RANK": "0", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(store.port),
               "TORCHELASTIC_RUN_ID": "distlm-test", "TORCHELASTIC_USE_AGENT_STORE": "True",
               "TORCHELASTIC_RESTART_COUNT": "0", "OMP_NUM_THREADS": "1"}
        procs.append(subprocess.Popen([sys.executable, "-c", code, *argv], env=env, text=True,
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE))
    try:
        outputs = [p.communicate(timeout=timeout) for p in procs]
        return [subprocess.CompletedProcess(p.args, p.returncode, *output) for p, output in zip(procs, outputs)]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_a_peer_lost_during_a_save_ends_in_one_line_naming_it(data_dir, tmp_path, mode):
    """Rank 1 dies writing the checkpoint of update 2; rank 0 ends with the collective failure's
    one line, naming rank 1, well within --timeout-sec (a dead peer's connection closes)."""
    args = [a for a in common_args(data_dir, str(tmp_path)) if a != "--no-save"] + [
        "--batch-size", "2", "--timeout-sec", "60", "--max-update", "4", "--save-interval-updates", "2",
        "--log-format", "json", *(["--async-save"] if mode == "async" else [])]
    started = time.monotonic()
    rank0, rank1 = run_two_cli_ranks("train_with_rank_1_dying_in_save", args, timeout=120)
    assert rank1.returncode == DIED, rank1.stderr
    errors = [line for line in rank0.stderr.splitlines() if "error" in line.lower() or "Traceback" in line]
    assert rank0.returncode == 1 and len(errors) == 1, rank0.stderr
    # An asynchronous write overlaps the next updates; it is complete by the next save or the end.
    failed_in = "2" if mode == "sync" else "[234]"
    # The heartbeat publishes every 2 s here, so rank 1's last published update may lag.
    assert re.fullmatch(
        rf"distlm: error: rank 0: a collective of update {failed_in} did not complete \(--timeout-sec 60\): "
        r"ranks \[1\] stopped responding \(rank 1 last completed update [0-3]\)\. Cause: .*gloo.*", errors[0]), errors
    assert errors[0].count("did not complete") == 1, errors  # named once, not again around the save's own line
    assert time.monotonic() - started < 60


def test_a_silent_store_names_the_rank_that_serves_it():
    """The message when the heartbeat's store does not answer, by who serves it (pure logic)."""
    assert describe_missing(None, 5, me=2, world_size=4, store_host=0, completed=4) == (
        "ranks [0] stopped responding (rank 0 serves the rendezvous store, which does not answer either); "
        "ranks [2] still wait in update 5 (rank 2 last completed update 4); "
        "the other 2 ranks' progress is kept in that store")
    assert "agent" in describe_missing(None, 5, me=2, world_size=4, store_host=None, completed=4)
    assert "the store this rank serves" in describe_missing(None, 5, me=0, world_size=4, store_host=0, completed=4)


def test_a_rank_stopped_right_after_an_update_is_reported_at_that_update():
    """Progress reaches the store when it moves, not at the next beat: with beats a second
    apart, a rank stopped 0.1 s after finishing update 3 was reported at update 0."""
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    beats = [Heartbeat("127.0.0.1", store.port, rank, 2, interval=1.0) for rank in range(2)]
    try:
        for update in (1, 2, 3):
            beats[1].entered = update
            beats[1].completed = update
        beats[0].entered = 4
        time.sleep(0.1)
        beats[1].close()  # as SIGSTOP would: it beats no more
        assert beats[0].describe_missing(4) == "ranks [1] stopped responding (rank 1 last completed update 3)"
    finally:
        for beat in beats:
            beat.close()
