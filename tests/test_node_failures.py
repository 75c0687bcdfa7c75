"""Node failures: restarts across torchrun agents, lost agents, lost links, lost shards.

The store tests need no process group: each rank's side of distlm/attempt_store.py runs
on a thread against a TCPStore that stands in for torchrun's agent.
"""

from __future__ import annotations

import datetime
import json
import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest
import torch.distributed as dist

from distlm import attempt_store
from distlm.backends import DistributedTimeout
from distlm.backends.base import create_store
from distlm.checkpoint import integrity
from distlm.checkpoint.lock import GUARD_FILE
from distlm.env import ClusterEnv

SHORT = datetime.timedelta(seconds=1)


def torchrun_env(rank: int, port: int) -> ClusterEnv:
    return ClusterEnv(rank=rank, world_size=2, local_rank=0, local_world_size=1, node_rank=rank, num_nodes=2,
                      master_addr="127.0.0.1", master_port=port, launcher="torchelastic")


def agent_environ(restart: int) -> dict[str, str]:
    return {"TORCHELASTIC_USE_AGENT_STORE": "True", "TORCHELASTIC_RESTART_COUNT": str(restart)}


def join_both(agent_port: int, restarts: tuple[int, int], timeout=datetime.timedelta(seconds=20)) -> list:
    """Both ranks' stores of one attempt, rank 0 on a thread (it waits for rank 1's mark)."""
    stores: list = [None, None]
    errors: list = []

    def rank0() -> None:
        try:
            stores[0] = create_store(torchrun_env(0, agent_port), timeout, agent_environ(restarts[0]))
        except BaseException as err:  # noqa: BLE001 - re-raised below, in the test's thread
            errors.append(err)

    thread = threading.Thread(target=rank0)
    thread.start()
    stores[1] = create_store(torchrun_env(1, agent_port), timeout, agent_environ(restarts[1]))
    thread.join(30)
    if errors:
        raise errors[0]
    return stores


@pytest.fixture
def agent():
    store = dist.TCPStore("127.0.0.1", 0, None, is_master=True, wait_for_workers=False)
    yield store
    del store


def test_ranks_meet_in_rank_0s_store_not_in_the_agents(agent):
    rank0, rank1 = join_both(agent.port, (0, 0))
    rank1.set("from-rank-1", "hi")
    assert rank0.get("from-rank-1") == b"hi"
    # The agent's store, which outlives the attempt, holds only the announcement.
    assert agent.num_keys() == 1 and agent.check([attempt_store.ANNOUNCEMENT_KEY])


def test_a_membership_restart_meets_despite_different_restart_counts(agent, caplog):
    # torchrun counts a restart only on the node whose worker failed; the other node's agent
    # restarts its healthy worker with the count it had. The previous attempt's rank 0 left
    # its announcement and its gloo keys behind in the agent's store.
    first0, first1 = join_both(agent.port, (0, 0))
    first1.set("0//cpu//0/1", "the previous attempt's address")
    old = agent.get(attempt_store.ANNOUNCEMENT_KEY)
    del first0, first1  # the previous attempt's processes are gone, and with rank 0 its store
    with caplog.at_level(logging.WARNING, logger="distlm"):
        rank0, rank1 = join_both(agent.port, (0, 1))
    assert agent.get(attempt_store.ANNOUNCEMENT_KEY) != old
    assert not rank0.check(["0//cpu//0/1"])  # nothing of the previous attempt is read
    rank0.set("k", "v")
    assert rank1.get("k") == b"v"
    assert "rank 1: rank 0's store at 127.0.0.1:" in caplog.text and "is the previous attempt's" in caplog.text
    assert "waiting up to 100 s for the new rank 0" in caplog.text  # 2 x 20 s + 60 s
    assert "rank 0: torchrun restarted the job (restart 0 here)" in caplog.text


def test_a_rank_never_joins_the_store_its_previous_process_joined(agent, monkeypatch):
    # A static rendezvous restarts each node on its own: rank 1's successor may start while
    # the previous rank 0 still runs and its store still answers.
    monkeypatch.setattr(attempt_store, "RESTART_ALLOWANCE_SEC", 0.0)
    first0, first1 = join_both(agent.port, (0, 0))
    with pytest.raises(DistributedTimeout, match=r"rank 1 of world size 2 .*: rank 0 did not announce a store .* "
                                                 r"within 2 s"):
        create_store(torchrun_env(1, agent.port), SHORT, agent_environ(1))
    del first0, first1


def test_rank_0_names_the_ranks_that_did_not_join(agent):
    with pytest.raises(DistributedTimeout, match=r"rank 0 of world size 2 .*: ranks \[1\] did not join rank 0's store "
                                                 r"within 1 s"):
        create_store(torchrun_env(0, agent.port), SHORT, agent_environ(0))


# --------------------------------------------------------------------------- a lost agent

AGENT = textwrap.dedent('''
    import subprocess, sys
    worker = subprocess.Popen([sys.executable, "-c", sys.argv[1]], stdout=subprocess.PIPE, text=True)
    print(worker.pid, worker.stdout.readline().strip(), flush=True)
    worker.wait()
''')
WORKER = textwrap.dedent('''
    import time
    from distlm.signals import die_with_torchrun_agent
    print("armed" if die_with_torchrun_agent() else "not armed", flush=True)
    time.sleep(60)
''')


def alive(pid: int) -> bool:
    """Running, not dead and not a zombie waiting for whoever adopted it to reap it."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError):
        return False
    return state not in ("Z", "X")


@pytest.mark.parametrize("under_torchrun", [True, False])
def test_a_worker_dies_with_its_torchrun_agent(under_torchrun):
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    env.pop("TORCHELASTIC_RUN_ID", None)
    if under_torchrun:
        env["TORCHELASTIC_RUN_ID"] = "job"
    agent = subprocess.Popen([sys.executable, "-c", AGENT, WORKER], stdout=subprocess.PIPE, text=True, env=env)
    pid, state = agent.stdout.readline().split(maxsplit=1)
    worker = int(pid)
    try:
        assert state.strip() == ("armed" if under_torchrun else "not armed")
        agent.kill()  # SIGKILL: the agent can stop nothing
        agent.wait()
        # The kernel signals the worker as the agent exits; a second is ample, even under load.
        deadline = time.monotonic() + (5 if under_torchrun else 1)
        while alive(worker) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert alive(worker) != under_torchrun  # a worker outside torchrun is left alone
    finally:
        if alive(worker):
            os.kill(worker, signal.SIGKILL)


# ------------------------------------------------ a save dir that is not one file system

# Rank 1 runs in a mount namespace of its own, where it puts a directory of its own over
# --save-dir: a node-local disk, from the start (at update 0) or from a later save on.
NODE_LOCAL = textwrap.dedent('''
    import os, subprocess, sys
    from distlm.checkpoint.checkpointer import Checkpointer
    from distlm.train import run

    at, local, save_dir = int(os.environ["NODE_LOCAL_AT"]), os.environ["NODE_LOCAL_DIR"], os.environ["SAVE_DIR"]

    def mount():
        subprocess.run(["mount", "--bind", local, save_dir], check=True)

    if os.environ["RANK"] == "1":
        if at == 0:
            mount()
        else:
            save = Checkpointer.save
            def save_then_lose(self, names, states, *args, **kwargs):
                if states["progress"].num_updates == at:
                    mount()
                return save(self, names, states, *args, **kwargs)
            Checkpointer.save = save_then_lose
    run()
''')


def launch_node_local(data_dir: str, tmp_path: Path, at: int) -> subprocess.CompletedProcess:
    """distlm-run of 2 ranks, rank 1 in its own mount namespace (``unshare`` execs, so the
    worker stays torchrun's child) seeing its own --save-dir from update ``at`` on."""
    if os.geteuid() != 0 or shutil.which("unshare") is None:
        pytest.skip("a node-local disk is simulated with a mount namespace: needs root and unshare")
    save_dir, local = tmp_path / "shared", tmp_path / "node1-disk"
    save_dir.mkdir()
    local.mkdir()
    wrapper = tmp_path / "node.sh"
    wrapper.write_text('#!/bin/sh\n[ "$RANK" = 1 ] && exec unshare -m --propagation private "$@"\nexec "$@"\n')
    wrapper.chmod(0o755)
    args = ["--data", data_dir, "--arch", "llama_tiny", "--tokens-per-sample", "32", "--batch-size", "2",
            "--max-update", "4", "--save-interval-updates", "2", "--log-interval", "1000", "--disable-validation",
            "--save-dir", str(save_dir), "--device", "cpu", "--seed", "1"]
    command = [sys.executable, "-m", "distlm.run", "--standalone", "--nproc_per_node", "2", "--no-python",
               str(wrapper), sys.executable, "-c", NODE_LOCAL, *args]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "NODE_LOCAL_AT": str(at), "NODE_LOCAL_DIR": str(local),
           "SAVE_DIR": str(save_dir), "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    return subprocess.run(command, cwd=tmp_path, capture_output=True, text=True, timeout=240, env=env)


def test_a_node_local_save_dir_is_refused_before_the_first_update(data_dir, tmp_path):
    proc = launch_node_local(data_dir, tmp_path, at=0)
    assert proc.returncode == 2, proc.stderr[-3000:]
    errors = [line for line in proc.stderr.splitlines() if "error" in line]
    host = socket.gethostname()
    assert errors == [
        f"distlm: error: --save-dir {tmp_path / 'shared'}: rank 1 (host {host}) cannot read the file rank 0 wrote "
        f"(missing); rank 0 cannot read the files written by rank 1 (host {host}): every rank reads every "
        "checkpoint, so --save-dir must be one file system shared by all nodes"], proc.stderr[-3000:]
    assert '"update"' not in proc.stdout + proc.stderr  # refused before the first update
    # No lock (its guard file stays, as after every run) and no probe file left behind.
    assert [path.name for path in (tmp_path / "shared").iterdir()] == [GUARD_FILE]


def test_a_save_that_loses_a_shard_is_not_reported_saved(data_dir, tmp_path):
    # From the save at update 4 on, rank 1 writes to a disk of its own.
    proc = launch_node_local(data_dir, tmp_path, at=4)
    assert proc.returncode == 2, proc.stderr[-3000:]
    save_dir = tmp_path / "shared"
    last_line = proc.stderr.strip().splitlines()[-1]
    assert last_line == (
        f"distlm: error: saving checkpoint_4, checkpoint_last in {save_dir} failed: shard __1_0.distcp written by "
        f"rank 1 is not in {save_dir / '.incomplete-checkpoint_4'} as rank 0 sees it: every rank reads every "
        "checkpoint, so --save-dir must be one file system shared by all nodes; the previous checkpoint is intact")
    assert "saved checkpoint_4" not in proc.stderr
    # checkpoint_last is still the save of update 2, whole; nothing of the failed save is left.
    meta = json.loads((save_dir / "checkpoint_last" / "distlm.json").read_text())
    assert meta["progress"]["num_updates"] == 2
    assert integrity.verify(save_dir / "checkpoint_last", integrity.recorded_files(meta, save_dir)) is None
    assert not list(save_dir.glob(".incomplete-*")) and not (save_dir / "checkpoint_4").exists()
    # Rank 1's shard went where no reader looks.
    assert (tmp_path / "node1-disk" / ".incomplete-checkpoint_4" / "__1_0.distcp").is_file()
