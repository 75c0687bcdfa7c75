"""Run a function on N real gloo processes, the way torchrun would start them.

The parent hosts the TCPStore on a port the OS picks (no guessed free port), and the
workers join it as torchrun's workers join the agent's store. Each worker's return
value comes back through a file. A worker that fails or hangs fails the test, with
its traceback, after ``timeout`` seconds at most.

Starting the processes and torch costs more than most scenarios on the tiny models, so a
module runs its scenarios of one world size in one job: ``Scenarios`` runs named
(function, args) pairs in turn on the same ranks and keeps each one's result or traceback
apart, for the tests to assert (and fail) one by one.

The workers are forked from multiprocessing's fork server, one fresh interpreter per test
session that has imported torch, numpy, pytest and distlm's trainer once (about 4-5 s of
CPU that each spawned worker used to spend on those imports), and has run nothing else:
no thread pool, process group or test state exists there to be inherited. What spawn
gave a worker and a fork would not is passed explicitly: the parent's environment as it
is now (the server's is the one it was started with) is the worker's, and its working
directory and sys.path come with multiprocessing's preparation data as under spawn. The
server keeps the stdout and stderr it started with (under pytest, the session's capture).
"""

from __future__ import annotations

import os
import pickle
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any, Callable

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from multiprocessing import forkserver

from distlm.errors import exit_without_teardown


# Imported once by the fork server, for every worker forked from it.
# torch._dynamo too: every torch optimizer imports it on its first parameter group, about half a
# second that each worker would otherwise pay again.
PRELOAD = ["torch", "torch.distributed", "torch._dynamo", "numpy", "pytest", "distlm.training.trainer"]


def _worker(rank: int, world_size: int, port: int, out_dir: str, fn: Callable, args: tuple, env: dict,
            parent_env: dict) -> None:
    os.environ.clear()
    os.environ.update(parent_env)
    os.environ.update(
        RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_RANK=str(rank),
        LOCAL_WORLD_SIZE=str(world_size),
        GROUP_RANK="0",
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        TORCHELASTIC_RUN_ID="distlm-test",
        TORCHELASTIC_USE_AGENT_STORE="True",
        TORCHELASTIC_RESTART_COUNT="0",
        OMP_NUM_THREADS="1",
        **env,
    )
    # torch read the thread count when the fork server imported it, from the server's
    # environment: set it from this worker's, as a spawned worker would have read it.
    torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
    result_file = Path(out_dir) / f"rank{rank}.pkl"
    try:
        result = ("ok", fn(*args))
    except BaseException:  # noqa: BLE001 - the parent re-raises it with the traceback
        result = ("error", traceback.format_exc())
    with open(result_file, "wb") as f:
        pickle.dump(result, f)
    # The process group is not destroyed: destroying it while gloo's worker thread still
    # releases the last collective's tensors killed a worker with SIGSEGV after its
    # function had returned. Ending the process without teardown closes the sockets.
    exit_without_teardown(0)


def run_distributed(fn: Callable, world_size: int, *args: Any, timeout: float = 120.0, env: dict | None = None) -> list[Any]:
    """``fn(*args)`` on ``world_size`` processes; returns the per-rank results in rank order."""
    store = dist.TCPStore("127.0.0.1", 0, world_size + 1, is_master=True, wait_for_workers=False)
    with tempfile.TemporaryDirectory() as out_dir:
        forkserver.set_forkserver_preload(PRELOAD)  # read once, when the server starts
        context = mp.start_processes(
            _worker,
            args=(world_size, store.port, out_dir, fn, args, env or {}, dict(os.environ)),
            nprocs=world_size,
            join=False,
            start_method="forkserver",
        )
        deadline = time.monotonic() + timeout
        try:
            while not context.join(timeout=1.0):
                if time.monotonic() > deadline:
                    raise AssertionError(f"{world_size} workers did not finish within {timeout:.0f} s (hang?)")
        except mp.ProcessExitedException as exc:
            raise AssertionError(f"a worker died: {exc}") from None
        finally:
            # Also when pytest's own timeout interrupts the wait: no worker outlives its test.
            for process in context.processes:
                if process.is_alive():
                    process.kill()
        results = []
        for rank in range(world_size):
            path = Path(out_dir) / f"rank{rank}.pkl"
            if not path.exists():
                raise AssertionError(f"rank {rank} wrote no result")
            status, value = pickle.loads(path.read_bytes())
            if status == "error":
                raise AssertionError(f"rank {rank} failed:\n{value}")
            results.append(value)
    del store
    return results


def _run_scenarios(scenarios: list[tuple[str, Callable, tuple]]) -> dict[str, tuple[str, Any]]:
    """Each (name, fn, args) in turn on this rank: name -> ("ok", result) or ("error", traceback)."""
    results = {}
    for name, fn, args in scenarios:
        try:
            results[name] = ("ok", fn(*args))
        except Exception:  # noqa: BLE001 - the scenario's own test reports it
            results[name] = ("error", traceback.format_exc())
    return results


class Scenarios:
    """Named scenarios run in turn by one ``world_size``-rank job; ``scenarios[name]`` is that
    scenario's per-rank results, or fails the calling test with its traceback.

    A scenario that raises on every rank leaves the rest of the job running; one that
    fails on some ranks only leaves the others waiting in a collective until ``timeout``
    ends the job, and every scenario's test then fails with that."""

    def __init__(self, world_size: int, scenarios: list[tuple[str, Callable, tuple]], timeout: float = 600.0,
                 env: dict | None = None):
        names = [name for name, _, _ in scenarios]
        assert len(set(names)) == len(names), f"scenario names repeat: {names}"
        self.world_size = world_size
        self.failure = None
        try:
            self.ranks = run_distributed(_run_scenarios, world_size, scenarios, timeout=timeout, env=env)
        except AssertionError as failed:
            self.ranks, self.failure = [], str(failed)

    def __getitem__(self, name: str) -> list[Any]:
        if self.failure is not None:
            pytest.fail(f"the {self.world_size}-rank job of the scenarios failed: {self.failure}")
        for rank, results in enumerate(self.ranks):
            status, value = results[name]
            if status == "error":
                pytest.fail(f"scenario {name} failed on rank {rank}:\n{value}")
        assert len(self.ranks) == self.world_size
        return [results[name][1] for results in self.ranks]
