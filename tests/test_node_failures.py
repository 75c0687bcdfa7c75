"""Node failures: restarts across torchrun agents, lost agents, cut links, lost shards.

- The store of a restarted attempt (distlm/backends/attempt_store.py): each rank's side runs on a
  thread against a TCPStore that stands in for torchrun's agent; no process group.
- A worker dies with its agent: a plain process tree.
- A save dir that is not one file system: one 2-rank job whose rank 1 has a mount
  namespace of its own, where a directory mounted over --save-dir is its node-local disk.
- On the simulated cluster (tests/cluster.py, marker ``cluster``, one cluster of 4 nodes
  for the module, at most 4 training processes at once): a worker killed under
  --max-restarts, a killed agent, and cut links, with torchrun's c10d rendezvous.

About 2 minutes here, most of it the three cluster tests.
"""

from __future__ import annotations

import ctypes
import datetime
import json
import logging
import os
import re
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

from cluster import Cluster, require_cluster
from conftest import LAUNCHER_VARIABLES
from distributed import Scenarios
from distlm.backends import attempt_store
from distlm.backends import DistributedTimeout
from distlm.backends.base import create_store
from distlm.checkpoint import integrity
from distlm.checkpoint import Checkpointer, CheckpointError
from distlm.checkpoint.lock import GUARD_FILE
from distlm.config import parse_args
from distlm.launch.cluster_env import ClusterEnv
from distlm.errors import UsageError
from distlm.runtime.heartbeat import RankState, describe_missing
from distlm.training.trainer import Trainer
from test_launch import args_for, assert_models_identical, fit, last_checkpoint

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
    from distlm.runtime.signals import die_with_torchrun_agent
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
    """This thread, and the threads and processes it starts, get a mount namespace of their
    own whose mounts nobody else sees: where it mounts a directory over --save-dir, that is a
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


def rank_1_on_a_node_of_its_own() -> None:
    """The job's first scenario: rank 1 enters its mount namespace while it is still one
    thread (the namespace is the calling thread's, and threads started later inherit it)."""
    if int(os.environ["RANK"]) == 1:
        own_mount_namespace()


def refused_at_start(data_dir: str, root: Path) -> str:
    """Rank 1's --save-dir is a disk of its own from the start: training must not begin."""
    if int(os.environ["RANK"]) == 1:
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
    return root, Scenarios(2, [("namespace", rank_1_on_a_node_of_its_own, ()),
                               ("refused", refused_at_start, (data_dir, root)),
                               ("lost", loses_a_shard, (data_dir, root))], timeout=240)


def test_a_node_local_save_dir_is_refused_before_the_first_update(node_local):
    root, outcomes = node_local
    outcomes["namespace"]
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


# --------------------------------------------------------- on simulated nodes (tests/cluster.py)

TORCHRUN = [sys.executable, "-m", "torch.distributed.run"]
SAVE_EVERY = 4
# A collective's timeout short enough to keep the runs short, long enough for a loaded machine.
TIMEOUT_SEC = 10
# How long after --timeout-sec a rank may take to name whom it lost and end: reading the
# heartbeat (2 x max(2 s, 5 beats) + 3 beats of --timeout-sec / 10, at most 2 s each) and
# the process's end. docs/clusters.md states this margin.
MARGIN_SEC = 30
RUN_TIMEOUT = 240
# Node 1's worker of the first attempt dies (SIGKILL) right after checkpoint_4 is committed.
DIE_AFTER_SAVE = textwrap.dedent(f'''
    import os, signal
    from distlm.checkpoint.saving import CheckpointSaver
    from distlm.train import run

    commit = CheckpointSaver._commit
    def commit_then_die(self, names, meta, *hashed):
        commit(self, names, meta, *hashed)
        if os.environ["TORCHELASTIC_RESTART_COUNT"] == "0" and os.environ["RANK"] == "1" and "checkpoint_{SAVE_EVERY}" in names:
            os.kill(os.getpid(), signal.SIGKILL)
    CheckpointSaver._commit = commit_then_die
    run()
''')


@pytest.fixture(scope="module")
def cluster():
    """Four nodes: two jobs of two nodes can run side by side (4 training processes at most)."""
    require_cluster()
    with Cluster(nodes=4) as c:
        yield c


def cluster_args(data_dir: str, save_dir: Path, max_update: int) -> list[str]:
    return args_for(data_dir, save_dir, max_update, 2, ["--save-interval-updates", str(SAVE_EVERY),
                                                       "--timeout-sec", str(TIMEOUT_SEC)])


def torchrun_on(cluster: Cluster, nodes: tuple[int, int], run_id: str, argv: list[str], logs: Path,
                extra: list[str] = ()) -> list[subprocess.Popen]:
    """One torchrun agent per node of ``nodes``, c10d rendezvous on the first; output to ``logs``/nodeI.log."""
    rendezvous = ["--nnodes", "2", "--nproc-per-node", "1", "--rdzv-backend", "c10d",
                  "--rdzv-endpoint", f"{cluster.hostname(nodes[0])}:29400", "--rdzv-id", run_id, *extra]
    env = {**{k: v for k, v in os.environ.items() if k not in LAUNCHER_VARIABLES}, "OMP_NUM_THREADS": "1",
           "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    logs.mkdir(parents=True, exist_ok=True)
    return [cluster.popen(node, [*TORCHRUN, *rendezvous, *argv], env=env, cwd=logs,
                          stdout=open(logs / f"node{node}.log", "w"), stderr=subprocess.STDOUT)
            for node in nodes]


def wait_for(path: Path, agents: list[subprocess.Popen], logs: Path) -> None:
    deadline = time.monotonic() + RUN_TIMEOUT
    while not path.exists():
        if time.monotonic() > deadline or any(agent.poll() is not None for agent in agents):
            pytest.fail(f"{path.name} never appeared:\n" + "\n".join(
                log.read_text()[-2000:] for log in sorted(logs.glob("node*.log"))))
        time.sleep(0.1)


def end_times(pids: list[int], within: float) -> dict[int, float | None]:
    """Seconds until each of ``pids`` ended (None: still running after ``within``)."""
    started = time.monotonic()
    ended: dict[int, float | None] = {pid: None for pid in pids}
    while time.monotonic() - started < within and any(t is None for t in ended.values()):
        for pid in pids:
            if ended[pid] is None and not alive(pid):
                ended[pid] = round(time.monotonic() - started, 1)
        time.sleep(0.1)
    return ended


def error_lines(logs: Path, node: int) -> list[str]:
    return [line for line in (logs / f"node{node}.log").read_text().splitlines() if line.startswith("distlm: error")]


@pytest.mark.cluster
def test_a_restart_across_nodes_resumes_and_equals_an_uninterrupted_run(cluster, data_dir, tmp_path):
    save_dir, logs = tmp_path / "restarted", tmp_path / "logs"
    agents = torchrun_on(cluster, (0, 1), "restart", ["--max-restarts", "1", "--no-python", sys.executable, "-c",
                                                      DIE_AFTER_SAVE, *cluster_args(data_dir, save_dir, 8)], logs)
    reference = Scenarios(2, [("straight", fit, (cluster_args(data_dir, tmp_path / "straight", 8),))], timeout=240)
    for agent in agents:
        agent.wait(timeout=RUN_TIMEOUT)
    log = "\n".join((logs / f"node{node}.log").read_text() for node in (0, 1))
    assert [agent.returncode for agent in agents] == [0, 0], log[-4000:]
    # Node 1's agent counted a restart, node 0's restarted its healthy worker for the rejoining
    # node without counting one: both met in rank 0's new store and resumed the last checkpoint.
    assert f"resumed from {save_dir / 'checkpoint_last'} at update {SAVE_EVERY} " in log, log[-4000:]
    assert "rank 0: torchrun restarted the job (restart 0 here); waiting up to 80 s for ranks 1-1" in log
    reference["straight"]
    trained, straight = last_checkpoint(save_dir), last_checkpoint(tmp_path / "straight")
    assert trained["num_updates"] == straight["num_updates"] == 8
    assert_models_identical(trained["model"], straight["model"])


@pytest.mark.cluster
def test_a_killed_agent_takes_its_worker_and_the_job_ends(cluster, data_dir, tmp_path):
    """Node 1's agent is killed: its worker dies with it, rank 0 names it, and node 0's agent
    restarts and waits for node 1 to rejoin for no longer than docs/clusters.md's join_timeout."""
    save_dir, logs = tmp_path / "run", tmp_path / "logs"
    join_timeout = 5
    agents = torchrun_on(cluster, (0, 1), "agent", ["-m", "distlm.train", *cluster_args(data_dir, save_dir, 100000)],
                         logs, ["--max-restarts", "1", "--rdzv-conf", f"join_timeout={join_timeout}"])
    wait_for(save_dir / f"checkpoint_{SAVE_EVERY}", agents, logs)
    pids = cluster.pids(0) + cluster.pids(1)
    agents[1].kill()
    ended = end_times(pids, TIMEOUT_SEC + MARGIN_SEC + join_timeout)
    assert None not in ended.values(), (ended, error_lines(logs, 0))
    assert agents[0].wait() == 1
    [line] = error_lines(logs, 0)
    assert re.search(r"rank 0: a collective of update \d+ did not complete \(--timeout-sec 10\): ranks \[1\] stopped "
                     r"responding \(rank 1 last completed update \d+\) on host node1", line), line


@pytest.mark.cluster
def test_a_cut_link_ends_every_process_within_the_bound(cluster, data_dir, tmp_path):
    """Two jobs side by side, each cut off between its nodes: the workers of both end within
    --timeout-sec + MARGIN_SEC, each naming whom it lost; torchrun's agent on the cut-off node
    of the job without docs/clusters.md's kernel setting waits for TCP to give up (not
    asserted: torch's), and every process of the job with it ends within the bound too."""
    setting = next(line.strip() for line in (Path(__file__).resolve().parents[1] / "docs" / "clusters.md")
                   .read_text().splitlines() if line.strip().startswith("sysctl -w net.ipv4.tcp_retries2="))
    for node in (2, 3):
        cluster.run(node, setting.split(), check=True)
    jobs = {}
    for nodes in ((0, 1), (2, 3)):
        logs = tmp_path / f"logs{nodes[0]}"
        jobs[nodes] = torchrun_on(cluster, nodes, f"cut{nodes[0]}", ["-m", "distlm.train", *cluster_args(
            data_dir, tmp_path / f"run{nodes[0]}", 100000)], logs)
    for nodes, agents in jobs.items():
        wait_for(tmp_path / f"run{nodes[0]}" / f"checkpoint_{SAVE_EVERY}", agents, tmp_path / f"logs{nodes[0]}")
    unbounded = jobs[(0, 1)][1].pid  # node 1's agent, without the kernel setting
    before = {node: [pid for pid in cluster.pids(node) if pid != unbounded] for node in range(4)}
    cluster.cut(1)
    cluster.cut(3)
    ended = end_times([pid for pids in before.values() for pid in pids], TIMEOUT_SEC + MARGIN_SEC)
    late = {node: [pid for pid in before[node] if ended[pid] is None] for node in range(4)}
    assert late == {0: [], 1: [], 2: [], 3: []}, ended
    for first in (0, 2):  # each side names the rank and the host it lost, in one line
        [rank0], [rank1] = (error_lines(tmp_path / f"logs{first}", node) for node in (first, first + 1))
        assert re.search(r"ranks \[1\] stopped responding \(rank 1 last completed update \d+\) on host "
                         rf"node{first + 1}", rank0), rank0
        assert f"lost host node{first}: ranks [0] there and torchrun's agent store there" in rank1, rank1
