"""MPI: ``mpiexec`` launches of distlm, and the mpi4py gradient transport.

Two kinds of test. The checks of pure logic (thread level, CUDA-awareness decision,
missing mpi4py, the half-precision sums, failure handling) use stand-ins and run
everywhere. The rest start real ranks with ``mpiexec --allow-run-as-root --oversubscribe
-n N`` as a subprocess of this pytest process (the programs are in tests/mpi_worker.py)
and skip, with the reason shown by ``-ra``, where mpiexec or mpi4py is missing
(install: ``apt-get install openmpi-bin libopenmpi-dev && pip install 'distlm[mpi]'``).
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import signal
import subprocess
import sys
import types
from pathlib import Path

import numpy as np
import pytest
import torch

from distlm import checkpoint
from distlm.config import parse_args
from distlm.backends import get_backend
from distlm.launch.detect import detect_launch
from distlm.launch.hosts import Host, place_by_hosts
from distlm.launch.mpi import resolve_master_via_mpi
from distlm.errors import UsageError
from distlm.parallel import mpi_transport
from distlm.training.validation import validate
from distlm.parallel.mpi_transport import (
    MPITransport,
    check_mpi_launch,
    check_thread_level,
    decide_device_buffers,
    launched_by_mpi,
    mpi_transport_factory,
    parse_ompi_info_cuda,
    query_cuda_support,
    required_thread_level,
    wire_formats,
)
from distlm.training.trainer import Trainer
from distributed import run_distributed

pytestmark = pytest.mark.mpi

MPIEXEC = shutil.which("mpiexec")
HAVE_MPI4PY = importlib.util.find_spec("mpi4py") is not None
needs_mpiexec = pytest.mark.skipif(
    MPIEXEC is None or not HAVE_MPI4PY,
    reason=(
        "mpiexec not found (apt-get install openmpi-bin libopenmpi-dev)"
        if MPIEXEC is None
        else "mpi4py not installed (pip install 'distlm[mpi]')"
    ),
)
WORKER = Path(__file__).with_name("mpi_worker.py")
# A normal run takes 4-15 s here; past this it is hung.
SUBPROCESS_TIMEOUT = 240
UPDATES = 5


# --------------------------------------------------------------------- stand-ins


def standin_mpi(thread_level: int = 3, float16: bool = False) -> types.SimpleNamespace:
    """Just enough of ``mpi4py.MPI`` for the transport's bookkeeping (levels as in OpenMPI/MPICH)."""

    class Datatype:
        def __init__(self, name: str, valid: bool = True):
            self.name, self.valid = name, valid

        def Get_size(self) -> int:
            if not self.valid:
                raise RuntimeError("MPI_ERR_TYPE: invalid datatype")
            return 2

    return types.SimpleNamespace(
        THREAD_SINGLE=0, THREAD_FUNNELED=1, THREAD_SERIALIZED=2, THREAD_MULTIPLE=3,
        Query_thread=lambda: thread_level,
        DATATYPE_NULL=Datatype("MPI_DATATYPE_NULL"),
        FLOAT=Datatype("FLOAT"), DOUBLE=Datatype("DOUBLE"), INT32_T=Datatype("INT32_T"),
        INT64_T=Datatype("INT64_T"), INT16_T=Datatype("INT16_T"),
        FLOAT16_T=Datatype("FLOAT16_T", valid=float16), BFLOAT16_T=Datatype("BFLOAT16_T", valid=False),
        SUM="SUM", IN_PLACE="IN_PLACE",
        Op=types.SimpleNamespace(Create=lambda fn, commute: ("user op", fn, commute)),
    )


class FailingComm:
    """A 2-rank communicator whose second Iallreduce fails, as a broken link would."""

    def __init__(self):
        self.calls = 0

    def Get_size(self):
        return 2

    def Get_rank(self):
        return 0

    def Allreduce(self, sendbuf, recvbuf, op):
        self.calls += 1
        if self.calls == 2:
            raise RuntimeError("MPI_ERR_OTHER: link down")
        buffer, _ = recvbuf
        buffer *= 2  # "the peer holds the same values"

    def Iallreduce(self, sendbuf, recvbuf, op):
        self.Allreduce(sendbuf, recvbuf, op)
        return types.SimpleNamespace(Wait=lambda: None)


# --------------------------------------------------------------------- pure logic


def test_missing_mpi4py_says_how_to_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "mpi4py", None)  # makes `import mpi4py` fail
    with pytest.raises(UsageError, match=r"pip install 'distlm\[mpi\]'"):
        mpi_transport_factory("cpu", environ={"OMPI_COMM_WORLD_SIZE": "2"})
    with pytest.raises(UsageError, match=r"pip install 'distlm\[mpi\]'"):
        MPITransport(comm=None)


def test_mpi_transport_without_an_mpi_launcher_is_refused(monkeypatch):
    # mpi4py "installed" (a stand-in package without the MPI module): the launcher check
    # must come before `from mpi4py import MPI`, which would initialise MPI as a singleton.
    monkeypatch.setitem(sys.modules, "mpi4py", types.ModuleType("mpi4py"))
    with pytest.raises(UsageError, match="mpiexec -n N python -m distlm.train"):
        mpi_transport_factory("cpu", environ={"RANK": "0", "WORLD_SIZE": "2", "MASTER_ADDR": "h"})


def test_mpi_launch_is_recognised_from_each_process_manager():
    assert launched_by_mpi({"OMPI_COMM_WORLD_SIZE": "2"})  # OpenMPI
    assert launched_by_mpi({"PMI_SIZE": "2"})  # MPICH / Intel MPI (Hydra), srun --mpi=pmi2
    assert launched_by_mpi({"PMIX_RANK": "0"})  # PMIx launchers
    assert not launched_by_mpi({"RANK": "0", "WORLD_SIZE": "2", "SLURM_PROCID": "0"})
    check_mpi_launch({"OMPI_COMM_WORLD_SIZE": "2"})  # no error


def test_thread_level_below_what_the_transport_needs_is_refused():
    mpi = standin_mpi()
    # One transport: its thread and the main thread take turns (SERIALIZED); two or
    # more: several threads may be inside MPI at once (MULTIPLE).
    assert required_thread_level(1, mpi) == mpi.THREAD_SERIALIZED
    assert required_thread_level(2, mpi) == mpi.THREAD_MULTIPLE
    check_thread_level(mpi.THREAD_SERIALIZED, mpi.THREAD_SERIALIZED)
    check_thread_level(mpi.THREAD_MULTIPLE, mpi.THREAD_SERIALIZED)
    with pytest.raises(UsageError, match="MPI_THREAD_FUNNELED.*needs MPI_THREAD_SERIALIZED.*MPI4PY_RC_THREAD_LEVEL"):
        check_thread_level(mpi.THREAD_FUNNELED, mpi.THREAD_SERIALIZED)
    with pytest.raises(UsageError, match="MPI_THREAD_SERIALIZED.*needs MPI_THREAD_MULTIPLE"):
        check_thread_level(mpi.THREAD_SERIALIZED, mpi.THREAD_MULTIPLE)
    # The transport asks MPI at construction and refuses before touching the communicator.
    with pytest.raises(UsageError, match="MPI_THREAD_FUNNELED"):
        MPITransport(comm=None, MPI=standin_mpi(thread_level=1))
    with pytest.raises(UsageError, match="MPI_THREAD_SINGLE"):
        MPITransport(comm=None, thread_level=0, MPI=standin_mpi())


def test_a_second_live_transport_needs_thread_multiple():
    mpi = standin_mpi(thread_level=2)  # SERIALIZED
    first = MPITransport(FailingComm(), MPI=mpi)
    try:
        with pytest.raises(UsageError, match="needs MPI_THREAD_MULTIPLE"):
            MPITransport(FailingComm(), MPI=mpi)
    finally:
        first.close()
    MPITransport(FailingComm(), MPI=mpi).close()  # fine again once the first is closed


def test_cuda_aware_decision():
    assert decide_device_buffers("cpu", None) is False  # host buffers, whatever the build
    assert decide_device_buffers("cpu", False) is False
    assert decide_device_buffers("cuda", True) is True
    with pytest.raises(UsageError, match="is not CUDA-aware.*--comm-transport torch"):
        decide_device_buffers("cuda", False)
    with pytest.raises(UsageError, match="does not say whether it is CUDA-aware"):
        decide_device_buffers("cuda", None)
    with pytest.raises(UsageError, match="not neuron"):
        decide_device_buffers("neuron", None)


def test_cuda_support_is_read_from_mpi_or_ompi_info(monkeypatch):
    line = "mca:mpi:base:param:mpi_built_with_cuda_support:value:{}\n"
    noise = "mca:opal:base:param:opal_cuda_support:value:false\n"
    assert parse_ompi_info_cuda(noise + line.format("true")) is True
    assert parse_ompi_info_cuda(noise + line.format("false")) is False
    assert parse_ompi_info_cuda("mca:opal:base:param:opal_built_with_cuda_support:value:true\n") is True
    assert parse_ompi_info_cuda(noise) is None  # MPICH has no ompi_info; nor a stripped one
    # MPIX_Query_cuda_support, where mpi4py exposes it, is the runtime answer.
    assert query_cuda_support(types.SimpleNamespace(Query_cuda_support=lambda: True)) is True
    assert query_cuda_support(types.SimpleNamespace(Query_cuda_support=lambda: False)) is False

    def unsupported():
        raise NotImplementedError("MPIX_Query_cuda_support")

    monkeypatch.setattr(mpi_transport.shutil, "which", lambda name: None)
    assert query_cuda_support(types.SimpleNamespace(Query_cuda_support=unsupported)) is None


# mpiexec -n 4 with 2 ranks per host and an exported master, as a job script may run it.
MPIEXEC_4_RANKS = {"OMPI_COMM_WORLD_RANK": "1", "OMPI_COMM_WORLD_SIZE": "4", "OMPI_COMM_WORLD_LOCAL_RANK": "0",
                   "OMPI_COMM_WORLD_LOCAL_SIZE": "2", "MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "29500"}
TORCHRUN_2_NODES = {"TORCHELASTIC_RUN_ID": "x", "RANK": "3", "WORLD_SIZE": "4", "LOCAL_RANK": "1",
                    "LOCAL_WORLD_SIZE": "2", "MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "29500"}


@pytest.mark.parametrize("environ", [MPIEXEC_4_RANKS, TORCHRUN_2_NODES])
def test_a_launcher_that_does_not_say_the_nodes_is_placed_by_the_hosts(monkeypatch, environ):
    # Without mpi4py nothing but the hosts says which ranks share one (--map-by node places
    # them round robin); torchrun variables without GROUP_RANK neither.
    monkeypatch.setitem(sys.modules, "mpi4py", None)  # makes `import mpi4py` fail
    env = resolve_master_via_mpi(detect_launch(environ))
    assert env.nodes_assumed is not None
    # Not refused before the rendezvous: the hosts gathered at start say it (start_run).
    hierarchical = parse_args(["--comm-hook", "hierarchical", "--device", "cpu", "--arch", "roberta_tiny"])
    assert validate(hierarchical, env, get_backend("cpu")).dp == 4
    round_robin = [Host("a", "boot-a", 1), Host("b", "boot-b", 1)] * 2
    placed, _ = place_by_hosts(env, round_robin, [rank // 2 for rank in range(4)])
    assert placed.node_of_rank == (0, 1, 0, 1) and placed.nodes_assumed is None


def test_half_precision_travels_as_16_bit_words_with_a_half_sum():
    # OpenMPI 4.1 defines no MPI_FLOAT16_T: 16-bit words and a user-defined sum, not fp32.
    formats = wire_formats(standin_mpi(float16=False))
    for dtype in (torch.float16, torch.bfloat16):
        assert formats[dtype].view_dtype == torch.int16 and not formats[dtype].native
        assert formats[dtype].op[0] == "user op" and formats[dtype].op[2] is True  # commutative
    assert formats[torch.float32].native and formats[torch.float32].op == "SUM"
    # A library that has the type gets it, with MPI_SUM.
    native = wire_formats(standin_mpi(float16=True))[torch.float16]
    assert native.native and native.datatype.name == "FLOAT16_T" and native.op == "SUM"


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_user_defined_half_sum_rounds_like_a_native_half_addition(dtype):
    gen = torch.Generator().manual_seed(0)
    a = (torch.randn(10007, generator=gen) * 2.0 ** torch.randint(-20, 15, (10007,), generator=gen)).to(dtype)
    b = (torch.randn(10007, generator=gen) * 2.0 ** torch.randint(-20, 15, (10007,), generator=gen)).to(dtype)
    a[:4] = torch.tensor([60000.0, -60000.0, float("inf"), float("nan")]).to(dtype)
    b[:4] = torch.tensor([60000.0, 1.0, 1.0, 1.0]).to(dtype)
    inbuf = bytearray(a.view(torch.int16).numpy().tobytes())
    outbuf = bytearray(b.view(torch.int16).numpy().tobytes())
    fn = mpi_transport._sum_float16 if dtype == torch.float16 else mpi_transport._sum_bfloat16
    fn(memoryview(inbuf), memoryview(outbuf), None)
    result = torch.frombuffer(outbuf, dtype=torch.int16).view(dtype)
    # torch adds two half tensors with one rounding of the exact sum, as MPI_SUM would.
    torch.testing.assert_close(result, b + a, rtol=0, atol=0, equal_nan=True)
    if dtype == torch.float16:
        assert result[0] == float("inf")  # 120000 overflows fp16: no silent fp32 detour


@pytest.mark.parametrize("nonblocking", [False, True])
def test_transport_checks_its_input_and_fails_every_later_request_after_an_error(nonblocking):
    transport = MPITransport(FailingComm(), nonblocking=nonblocking, MPI=standin_mpi())
    try:
        with pytest.raises(UsageError, match="cannot sum torch.bool"):
            transport.all_reduce_sum(torch.zeros(3, dtype=torch.bool))
        with pytest.raises(ValueError, match="contiguous"):
            transport.all_reduce_sum(torch.zeros(4, 4).t())
        first = transport.all_reduce_sum(torch.ones(3))
        assert torch.equal(first.wait(), torch.full((3,), 2.0))
        broken = transport.all_reduce_sum(torch.ones(3))
        with pytest.raises(RuntimeError, match="link down"):
            broken.wait()
        later = transport.all_reduce_sum(torch.ones(3))
        with pytest.raises(RuntimeError, match="earlier MPI all-reduce failed"):
            later.wait()
    finally:
        transport.close()
    with pytest.raises(RuntimeError, match="after close"):
        transport.all_reduce_sum(torch.ones(3))


class CountingComm:
    """A 2-rank communicator whose requests finish only when waited; it records the most outstanding."""

    def __init__(self):
        self.outstanding = self.most = 0

    def Get_size(self):
        return 2

    def Get_rank(self):
        return 0

    def Iallreduce(self, sendbuf, recvbuf, op):
        self.outstanding += 1
        self.most = max(self.most, self.outstanding)
        buffer, _ = recvbuf

        def wait():
            np.multiply(buffer, 2, out=buffer)
            self.outstanding -= 1

        return types.SimpleNamespace(Wait=wait)


def test_transport_keeps_at_most_max_in_flight_requests_outstanding():
    comm = CountingComm()
    transport = MPITransport(comm, nonblocking=True, max_in_flight=3, MPI=standin_mpi())
    try:
        tensors = [torch.full((5,), float(i)) for i in range(40)]
        futures = [transport.all_reduce_sum(t) for t in tensors]
        for i, future in enumerate(futures):
            assert torch.equal(future.wait(), torch.full((5,), 2.0 * i))
    finally:
        transport.close()
    assert 1 <= comm.most <= 3 and comm.outstanding == 0


# --------------------------------------------------------------------- real mpiexec


def mpiexec(ranks: int, program: list[str], cwd: Path) -> subprocess.CompletedProcess:
    """``mpiexec -n ranks program`` with a time limit; its whole process group is killed on expiry."""
    command = [
        MPIEXEC, "--allow-run-as-root", "--oversubscribe", "--bind-to", "none", "-n", str(ranks), *program,
    ]
    # conftest.py already removed every launcher variable from os.environ.
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen(
        command, cwd=cwd, env=env, text=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True
    )
    try:
        out, err = proc.communicate(timeout=SUBPROCESS_TIMEOUT)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        raise AssertionError(f"mpiexec -n {ranks} did not finish in {SUBPROCESS_TIMEOUT} s:\n{err[-4000:]}")
    return subprocess.CompletedProcess(command, proc.returncode, out, err)


def run_worker(job: str, ranks: int, tmp_path: Path) -> list[dict]:
    out_dir = tmp_path / job
    out_dir.mkdir()
    proc = mpiexec(ranks, [sys.executable, str(WORKER), job, str(out_dir)], tmp_path)
    errors = [f"{p.name}:\n{p.read_text()}" for p in sorted(out_dir.glob("*.error"))]
    assert not errors and proc.returncode == 0, "\n".join(errors) or proc.stderr[-4000:]
    return [json.loads((out_dir / f"rank{r}.json").read_text()) for r in range(ranks)]


@pytest.fixture(scope="module")
def two_rank_worker(tmp_path_factory) -> list[dict]:
    return run_worker("two_ranks", 2, tmp_path_factory.mktemp("mpi"))


@needs_mpiexec
def test_transport_sums_back_to_back_requests_on_its_own_thread(two_rank_worker):
    from mpi_worker import TRANSPORT_CASES

    for result in [r[mode] for r in two_rank_worker for mode in ("transport", "transport_nonblocking")]:
        assert result["size"] == 2
        # The main thread only polled done(): the transport's thread completed every request.
        assert result["completed"], result
        for name, _, _ in TRANSPORT_CASES:
            # 2 ranks: each element is one rounded addition, in MPI as in the reference.
            assert result["results"][name] == {"same_tensor": True, "equal": True, "max_abs_diff": 0.0}, name
        # FIFO: requests complete in the order they were issued.
        assert result["completion_order"] == list(range(len(TRANSPORT_CASES)))
        assert f"distlm-mpi-transport-{result['rank']}" in result["callback_threads"]
        assert "after close" in result["after_close"]
        # Both ranks on one node: the inter-node communicator has one rank, and a
        # one-rank transport returns the tensor untouched without MPI traffic.
        assert result["inter_size"] == 1 and result["solo_unchanged"]


@needs_mpiexec
def test_ddp_hook_over_mpi_transport_equals_ddp_over_gloo(two_rank_worker):
    """``ddp_hook(allreduce_reducer(MPITransport))`` trains bit-identically to DDP's own gloo all-reduce."""
    first, second = (r["ddp_hook"] for r in two_rank_worker)
    # 1000 queued requests summed right, and gloo still worked after them (in-flight cap).
    assert first["flood_ok"] and second["flood_ok"]
    assert first["buckets"] >= 3  # several buckets in flight per backward
    for result in (first, second):
        # Both divide by 2 (exact) and add the two ranks' values once: same bits.
        assert result["max_diff_vs_gloo"] == 0.0
    assert first["digest"] == second["digest"]


@needs_mpiexec
def test_hierarchical_with_mpi_between_nodes_equals_gloo_between_nodes(tmp_path):
    """4 ranks as 2 simulated nodes of 2: the inter-node leg over MPI sub-communicators."""
    for result in run_worker("hierarchical", 4, tmp_path):
        for case, values in result["results"].items():
            # 2 nodes: the inter-node leg adds two values once, in MPI as in gloo.
            assert values["equal"] and values["max_abs_diff"] == 0.0, (case, values)
            # And it is the mean: fp32 rounding, or fp16's 2**-11 relative on the inter-node leg.
            bound = 2e-3 if "fp16" in case else 1e-6
            assert values["relative_error"] < bound, (case, values)


def train_args(data: str, save_dir: Path, extra: list[str] = ()) -> list[str]:
    return [
        "--data", data, "--arch", "roberta_tiny", "--tokens-per-sample", "32", "--batch-size", "2",
        "--dropout", "0", "--attention-dropout", "0", "--lr", "1e-3", "--warmup-updates", "2",
        "--max-update", str(UPDATES), "--log-interval", "1000", "--save-dir", str(save_dir),
        "--device", "cpu", "--seed", "3", "--timeout-sec", "60", *extra,
    ]


def fit(args: list[str]) -> dict:
    return Trainer(parse_args(args)).fit()


@pytest.fixture(scope="module")
def torchrun_style_checkpoint(data_dir, tmp_path_factory) -> dict:  # noqa: F811 - pytest fixture
    save_dir = tmp_path_factory.mktemp("torchrun_style")
    run_distributed(fit, 2, train_args(data_dir, save_dir))
    return checkpoint.load(save_dir / checkpoint.LAST)


@needs_mpiexec
@pytest.mark.parametrize("transport", ["torch", "mpi"])
def test_mpiexec_training_equals_torchrun_style(data_dir, torchrun_style_checkpoint, tmp_path, transport):  # noqa: F811
    """``mpiexec -n 2 python -m distlm.train`` trains the same model, bit for bit, as the
    torchrun-style harness: ranks from OMPI_COMM_WORLD_*, the master agreed through mpi4py.

    Bit-identical, not close: both runs see the same per-rank batches and reduce each
    gradient element as (a / 2) + (b / 2) once -- gloo's all-reduce in one case, MPI's
    (through the transport) in the other; with 2 ranks there is no other order to add in.
    """
    save_dir = tmp_path / "mpiexec"
    program = [sys.executable, "-m", "distlm.train", *train_args(data_dir, save_dir, ["--comm-transport", transport])]
    proc = mpiexec(2, program, tmp_path)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "Traceback" not in proc.stderr, proc.stderr[-4000:]
    if transport == "mpi":
        assert "over mpi4py" in proc.stderr  # the hook really took the MPI path
    state, reference = checkpoint.load(save_dir / checkpoint.LAST), torchrun_style_checkpoint
    assert state["world_size"] == reference["world_size"] == 2
    assert state["num_updates"] == reference["num_updates"] == UPDATES
    assert state["consumed_samples"] == reference["consumed_samples"]
    assert state["model"].keys() == reference["model"].keys()
    for name, value in reference["model"].items():
        assert torch.equal(state["model"][name], value), name
    # Training moved the weights, so equality is not two untouched initialisations.
    assert any(not torch.equal(value, state["model"][name]) for name, value in _initial_model(data_dir).items())


def _initial_model(data: str) -> dict:
    trainer = Trainer(parse_args(train_args(data, Path("unused"), ["--no-save"])))
    return {name: p.detach() for name, p in trainer.model.state_dict().items()}
