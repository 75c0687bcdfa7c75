"""Node failures: restarts across torchrun agents, lost agents, lost links, lost shards.

The store tests need no process group: each rank's side of distlm/attempt_store.py runs
on a thread against a TCPStore that stands in for torchrun's agent.
"""

from __future__ import annotations

import datetime
import logging
import os
import signal
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
