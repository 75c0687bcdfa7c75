"""Node failures: restarts across torchrun agents, lost agents, lost links, lost shards.

The store tests need no process group: each rank's side of distlm/attempt_store.py runs
on a thread against a TCPStore that stands in for torchrun's agent.
"""

from __future__ import annotations

import ctypes
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
from distlm.checkpoint.checkpointer import Checkpointer, CheckpointError
from distlm.config import parse_args
from distlm.errors import UsageError
from distlm.heartbeat import RankState, describe_missing
from distlm.trainer import Trainer
from distributed import Scenarios
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

_CLONE_NEWNS = 0x00020000


def own_mount_namespace() -> None:
    """This process (a worker forked single-threaded) gets a mount namespace of its own,
    whose mounts nobody else sees: where it mounts a directory over --save-dir, it has a
    node-local disk."""
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.unshare(_CLONE_NEWNS) != 0:
        raise OSError(ctypes.get_errno(), "unshare(CLONE_NEWNS)")
    subprocess.run(["mount", "--make-rprivate", "/"], check=True)


def mount_over(directory: Path, own_disk: Path) -> None:
    subprocess.run(["mount", "--bind", str(own_disk), str(directory)], check=True)


def node_local_args(data_dir: str, save_dir: Path) -> list[str]:
    return ["--data", data_dir, "--arch", "llama_tiny", "--tokens-per-sample", "32", "--batch-size", "2",
            "--max-update", "4", "--save-interval-updates", "2", "--log-interval", "1000", "--disable-validation",
            "--save-dir", str(save_dir), "--device", "cpu", "--seed", "1"]


def refused_at_start(data_dir: str, root: Path) -> str:
    """Rank 1's --save-dir is a disk of its own from the start: training must not begin."""
    if int(os.environ["RANK"]) == 1:
        own_mount_namespace()
        mount_over(root / "refused", root / "node1-disk-a")
    try:
        Trainer(parse_args(node_local_args(data_dir, root / "refused")))
    except UsageError as err:
        return str(err)
    return "no error"


def loses_a_shard(data_dir: str, root: Path) -> tuple[str, int]:
    """From the save at update 4 on, rank 1 writes to a disk of its own (a mount lost)."""
    save = Checkpointer.save

    def save_then_lose(self, names, states, *args, **kwargs):
        if int(os.environ["RANK"]) == 1 and states["progress"].num_updates == 4:
            mount_over(root / "lost", root / "node1-disk-b")
        return save(self, names, states, *args, **kwargs)

    Checkpointer.save = save_then_lose
    trainer = Trainer(parse_args(node_local_args(data_dir, root / "lost")))
    try:
        trainer.fit()
    except CheckpointError as err:
        return str(err), trainer.num_updates
    finally:
        Checkpointer.save = save
    return "no error", trainer.num_updates


@pytest.fixture(scope="module")
def node_local(data_dir, tmp_path_factory):
    """One 2-rank job, rank 1 in a mount namespace of its own: both scenarios' outcomes."""
    if os.geteuid() != 0:
        pytest.skip("a node-local disk is simulated with a mount namespace of one rank: needs root")
    root = tmp_path_factory.mktemp("node-local")
    for name in ("refused", "lost", "node1-disk-a", "node1-disk-b"):
        (root / name).mkdir()
    return root, Scenarios(2, [("refused", refused_at_start, (data_dir, root)),
                               ("lost", loses_a_shard, (data_dir, root))], timeout=240)


def test_a_node_local_save_dir_is_refused_before_the_first_update(node_local):
    root, outcomes = node_local
    host = socket.gethostname()
    # Every rank refuses, in the Trainer's start: no update ran. The entry point prints the
    # line and exits with status 2, as for any UsageError.
    assert outcomes["refused"] == [
        f"--save-dir {root / 'refused'}: rank 1 (host {host}) cannot read the file rank 0 wrote (missing); rank 0 "
        f"cannot read the files written by rank 1 (host {host}): every rank reads every checkpoint, so --save-dir "
        "must be one file system shared by all nodes"] * 2
    # No lock (its guard file stays, as after every run) and no probe file left behind.
    assert [path.name for path in (root / "refused").iterdir()] == [GUARD_FILE]


def test_a_save_that_loses_a_shard_is_not_reported_saved(node_local):
    root, outcomes = node_local
    save_dir = root / "lost"
    line = (f"saving checkpoint_4, checkpoint_last in {save_dir} failed: shard __1_0.distcp written by rank 1 is not "
            f"in {save_dir / '.incomplete-checkpoint_4'} as rank 0 sees it: every rank reads every checkpoint, so "
            "--save-dir must be one file system shared by all nodes; the previous checkpoint is intact")
    assert outcomes["lost"] == [(line, 4)] * 2
    # checkpoint_last is still the save of update 2, whole; nothing of the failed save is left.
    meta = json.loads((save_dir / "checkpoint_last" / "distlm.json").read_text())
    assert meta["progress"]["num_updates"] == 2
    assert integrity.verify(save_dir / "checkpoint_last", integrity.recorded_files(meta, save_dir)) is None
    assert not list(save_dir.glob(".incomplete-*")) and not (save_dir / "checkpoint_4").exists()
    # Rank 1's shard went where no reader looks.
    assert (root / "node1-disk-b" / ".incomplete-checkpoint_4" / "__1_0.distcp").is_file()


# ------------------------------------------------------------------ a lost host, named

def test_a_rank_cut_off_from_the_agents_store_names_the_host_it_lost():
    hosts = ["node0", "node0", "node1", "node1"]
    assert describe_missing(None, 11, 2, 4, None, 10, hosts) == (
        "lost host node0: ranks [0, 1] there and torchrun's agent store there, which holds every rank's progress, "
        "do not answer (a cut link, or the host stopped); rank 2 on host node1 still waits in update 11 (it last "
        "completed update 10)")
    # On the store's own host, its silence says nothing about a link; on one host, nor does a host name.
    for me, hosts in ((1, hosts), (2, ["a"] * 4)):
        assert describe_missing(None, 11, me, 4, None, 10, hosts).startswith("the ranks cannot be asked")


def test_ranks_that_stopped_are_named_with_their_hosts():
    states = [RankState(0, 11, 10, True), RankState(1, 11, 10, True), RankState(2, 11, 10, False),
              RankState(3, 10, 9, True)]
    assert describe_missing(states, 11, 0, 4, None, 10, ["n0", "n0", "n1", "n2"]) == (
        "ranks [2] stopped responding (rank 2 last completed update 10) on host n1; "
        "ranks [3] have not started update 11 (rank 3 last completed update 9) on host n2")
    assert describe_missing(None, 11, 1, 2, 0, 10, ["n0", "n1"]) == (
        "ranks [0] stopped responding (rank 0 serves the rendezvous store, which does not answer either) on host n0; "
        "ranks [1] still wait in update 11 (rank 1 last completed update 10)")
