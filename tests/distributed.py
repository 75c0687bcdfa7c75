"""Run a function on N real gloo processes, the way torchrun would start them.

The parent hosts the TCPStore on a port the OS picks (no guessed free port), and the
workers join it as torchrun's workers join the agent's store. Each worker's return
value comes back through a file. A worker that fails or hangs fails the test, with
its traceback, after ``timeout`` seconds at most.
"""

from __future__ import annotations

import os
import pickle
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any, Callable

import torch.distributed as dist
import torch.multiprocessing as mp

from distlm.errors import exit_without_teardown


def _worker(rank: int, world_size: int, port: int, out_dir: str, fn: Callable, args: tuple, env: dict) -> None:
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
        context = mp.start_processes(
            _worker,
            args=(world_size, store.port, out_dir, fn, args, env or {}),
            nprocs=world_size,
            join=False,
            start_method="spawn",
        )
        deadline = time.monotonic() + timeout
        try:
            while not context.join(timeout=1.0):
                if time.monotonic() > deadline:
                    for process in context.processes:
                        process.kill()
                    raise AssertionError(f"{world_size} workers did not finish within {timeout:.0f} s (hang?)")
        except mp.ProcessExitedException as exc:
            raise AssertionError(f"a worker died: {exc}") from None
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
