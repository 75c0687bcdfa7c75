"""Backends: device choice, precision and strategy rules, the EFA preset, TorchNeuron through a
stand-in torch_neuronx (tests/neuron_standin), and the shared process-group start on real
gloo processes. torch-xla itself is tested for real in test_xla.py (its own lane)."""

from __future__ import annotations

import dataclasses
import datetime
import logging
import os
import subprocess
import sys
import textwrap
import time
import types
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

import distlm
from distributed import run_distributed
from distlm.backends import DistributedInitError, DistributedTimeout, get_backend, resolve_device
from distlm.backends.cpu import CpuBackend
from distlm.backends.cuda import CudaBackend, check_cuda_precision, supports_gpudirect_rdma
from distlm.backends.efa import EFA_PRESET, EFA_RDMA_PRESET, apply_env_preset, configure_network, find_efa_devices
from distlm.backends.hardware import host_cores, measure_cpu_matmul_flops
from distlm.backends.neuron import NeuronBackend
from distlm.backends.xla import XlaBackend
from distlm.launch.cluster_env import ClusterEnv, single_process_env
from distlm.launch.detect import detect_launch
from distlm.launch.hosts import find_free_port
from distlm.errors import UsageError
from distlm.mesh import ParallelDims

REPO_ROOT = Path(distlm.__file__).resolve().parent.parent
NEURON_STANDIN = Path(__file__).resolve().parent / "neuron_standin"
PRECISIONS = ("fp32", "fp16", "bf16", "memory_efficient_fp16")


def make_env(rank: int = 0, world_size: int = 2, port: int | None = None, launcher: str = "explicit") -> ClusterEnv:
    return ClusterEnv(
        rank=rank, world_size=world_size, local_rank=rank, local_world_size=world_size, node_rank=0, num_nodes=1,
        master_addr="127.0.0.1", master_port=port, launcher=launcher,
    )


# --------------------------------------------------------------------------- registry


def test_auto_picks_cpu_on_this_machine():
    assert not torch.cuda.is_available()
    assert resolve_device("auto") == "cpu"
    backend = get_backend("auto")
    assert isinstance(backend, CpuBackend) and backend.dist_backend == "gloo"


def test_unknown_device_is_a_usage_error():
    with pytest.raises(UsageError, match="--device 'tpu'"):
        get_backend("tpu")


def test_explicit_devices_map_to_their_backends():
    devices = ("cpu", "cuda", "neuron", "xla")
    backends = [get_backend(d) for d in devices]
    assert [b.dist_backend for b in backends] == ["gloo", "nccl", "neuron", "xla"]
    assert [b.autocast_device_type for b in backends] == ["cpu", "cuda", "neuron", "xla"]
    assert [b.compile_backend for b in backends] == ["inductor", "inductor", "neuron", "openxla"]
    # torch_xla's clip_grad_norm_ raises for foreach=True; everywhere else the multi-tensor kernels run.
    assert [b.foreach_clip for b in backends] == [True, True, True, None]


def test_auto_picks_the_neuron_stack_that_is_installed(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "torch_neuronx", types.ModuleType("torch_neuronx"))
    assert resolve_device("auto", dev_root=tmp_path) == "cpu"  # a package but no /dev/neuron0
    (tmp_path / "neuron0").touch()
    assert resolve_device("auto", dev_root=tmp_path) == "neuron"
    # trn1's torch-neuronx is built on torch-xla.
    monkeypatch.setitem(sys.modules, "torch_xla", types.ModuleType("torch_xla"))
    assert resolve_device("auto", dev_root=tmp_path) == "xla"


def test_only_cuda_py_names_nccl():
    # A backend is chosen from the device; nothing else may hard-code NCCL.
    sources = [*(REPO_ROOT / "distlm" / "backends").glob("*.py"), *(REPO_ROOT / "distlm" / "launch").glob("*.py")]
    offenders = [p.name for p in sources if p.name != "cuda.py" and '"nccl"' in p.read_text()]
    assert offenders == []


# --------------------------------------------------------------------------- cpu


@pytest.mark.parametrize("precision", PRECISIONS)
def test_cpu_allows_every_precision(precision):
    CpuBackend().setup(single_process_env(), precision, "auto")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_cpu_autocast_device_type_really_autocasts(dtype):
    a, b = torch.randn(4, 4), torch.randn(4, 4)
    with torch.autocast(CpuBackend().autocast_device_type, dtype=dtype):
        out = a @ b
    assert out.dtype == dtype


def test_cpu_rejects_efa_and_unknown_names():
    backend = CpuBackend()
    with pytest.raises(UsageError, match="--network efa"):
        backend.setup(single_process_env(), "fp32", "efa")
    with pytest.raises(UsageError, match="--network 'ib'"):
        backend.setup(single_process_env(), "fp32", "ib")
    with pytest.raises(UsageError, match="precision 'fp8'"):
        backend.setup(single_process_env(), "fp8")


# --------------------------------------------------------------------------- cuda rules


def test_sm70_refuses_bf16_and_points_to_fp16():
    with pytest.raises(UsageError) as info:
        check_cuda_precision("bf16", (7, 0))
    assert "--fp16" in str(info.value) and "sm70" in str(info.value)
    with pytest.raises(UsageError, match="--fp16"):
        check_cuda_precision("bf16", (7, 5))  # T4 too


@pytest.mark.parametrize("capability", [(8, 0), (8, 6), (9, 0)])
def test_ampere_and_newer_allow_bf16(capability):
    check_cuda_precision("bf16", capability)


@pytest.mark.parametrize("precision", ["fp32", "fp16", "memory_efficient_fp16"])
def test_sm70_allows_the_rest(precision):
    check_cuda_precision(precision, (7, 0))


def test_cuda_on_a_cpu_machine_is_a_usage_error():
    with pytest.raises(UsageError, match=r"--device cuda but torch.cuda.is_available\(\) is False"):
        CudaBackend().setup(single_process_env(), "fp32")


def test_gpudirect_rdma_only_on_p4d_p5_class_gpus():
    assert [supports_gpudirect_rdma(c) for c in [(7, 0), (8, 0), (8, 6), (8, 9), (9, 0), (10, 0)]] == [
        False, True, False, False, True, True,
    ]


# --------------------------------------------------------------------------- EFA


def fake_sysfs(root: Path, *devices: str) -> Path:
    directory = root / "class" / "infiniband"
    directory.mkdir(parents=True)
    for name in devices:
        (directory / name).mkdir()
    return root


def test_efa_detection_from_a_fake_sysfs(tmp_path):
    assert find_efa_devices(fake_sysfs(tmp_path / "p4d", "rdmap16s27", "rdmap32s27", "mlx5_0")) == [
        "rdmap16s27", "rdmap32s27",
    ]
    assert find_efa_devices(fake_sysfs(tmp_path / "named", "efa_0")) == ["efa_0"]
    assert find_efa_devices(fake_sysfs(tmp_path / "mellanox", "mlx5_0")) == []
    assert find_efa_devices(tmp_path / "no-sysfs") == []


def test_apply_env_preset_sets_missing_and_keeps_user_values():
    environ = {"FI_PROVIDER": "tcp", "UNRELATED": "x"}
    applied, kept = apply_env_preset(EFA_PRESET, environ)
    assert kept == {"FI_PROVIDER": "tcp"}
    assert applied == {k: v for k, v in EFA_PRESET.items() if k != "FI_PROVIDER"}
    assert environ == {**EFA_PRESET, "FI_PROVIDER": "tcp", "UNRELATED": "x"}


@pytest.mark.parametrize("rdma", [False, True])
def test_efa_network_applies_preset_and_logs(tmp_path, caplog, rdma):
    root = fake_sysfs(tmp_path, "rdmap16s27")
    environ = {"FI_EFA_USE_HUGE_PAGE": "1"}  # the user's choice must survive
    with caplog.at_level(logging.INFO, logger="distlm"):
        applied = configure_network("efa", environ, gpudirect_rdma=rdma, sysfs_root=root, use_fi_info=False)
    expected = {**EFA_PRESET, **(EFA_RDMA_PRESET if rdma else {})}
    assert environ == {**expected, "FI_EFA_USE_HUGE_PAGE": "1"}
    assert applied == {k: v for k, v in expected.items() if k != "FI_EFA_USE_HUGE_PAGE"}
    assert ("FI_EFA_USE_DEVICE_RDMA" in environ) == rdma
    assert "NCCL_SOCKET_IFNAME" not in environ and "NCCL_PROTO" not in environ
    (record,) = [r for r in caplog.records if r.name.startswith("distlm")]
    assert "FI_PROVIDER=efa" in record.getMessage()
    assert "kept user values FI_EFA_USE_HUGE_PAGE=1" in record.getMessage()


def test_auto_network_applies_preset_only_with_a_device(tmp_path):
    environ: dict[str, str] = {}
    empty = fake_sysfs(tmp_path / "none")
    assert configure_network("auto", environ, True, sysfs_root=empty, use_fi_info=False) == {}
    assert environ == {}
    configure_network("auto", environ, False, sysfs_root=fake_sysfs(tmp_path / "efa", "efa_0"), use_fi_info=False)
    assert environ == EFA_PRESET


def test_efa_without_a_device_is_a_usage_error(tmp_path):
    environ: dict[str, str] = {}
    with pytest.raises(UsageError, match="--network efa but no EFA device"):
        configure_network("efa", environ, True, sysfs_root=fake_sysfs(tmp_path, "mlx5_0"), use_fi_info=False)
    assert environ == {}


def test_tcp_network_never_touches_the_environment(tmp_path):
    environ: dict[str, str] = {}
    configure_network("tcp", environ, True, sysfs_root=fake_sysfs(tmp_path, "rdmap0"), use_fi_info=False)
    assert environ == {}


# --------------------------------------------------------------------------- neuron (TorchNeuron)
#
# torch-neuronx cannot be installed here (it comes from AWS's repository and needs
# Trainium), so what is tested is the backend's device-independent logic: in this
# process the rules that need no device, and in spawned processes the rest, through the
# stand-in torch_neuronx of tests/neuron_standin. The stand-in registers the neuron device
# and a neuron process group (gloo under that name) the way the real package does; it
# changes torch process-wide, so it is only ever imported in child processes.


def test_neuron_refuses_fp16_and_points_to_bf16():
    backend = NeuronBackend()
    backend.check_precision("bf16")
    backend.check_precision("fp32")
    for precision, flag in (("fp16", "--fp16"), ("memory_efficient_fp16", "--memory-efficient-fp16")):
        with pytest.raises(UsageError, match=f"{flag} is not supported on --device neuron.*use --bf16"):
            backend.check_precision(precision)


def test_neuron_without_torch_neuronx_names_the_package(monkeypatch):
    monkeypatch.setitem(sys.modules, "torch_neuronx", None)  # makes `import torch_neuronx` fail
    with pytest.raises(UsageError) as info:
        NeuronBackend().setup(single_process_env(), "bf16", "tcp")
    message = str(info.value)
    assert "torch-neuronx 2.13.x or 2.14.x" in message and "pip.repos.neuron.amazonaws.com" in message
    torch_release = ".".join(torch.__version__.split("+")[0].split(".")[:2])
    assert f"torch-neuronx=={torch_release}.*" in message and "\n" not in message


def test_neuron_with_the_torch_xla_based_torch_neuronx_points_to_device_xla(monkeypatch):
    # The pre-2.33 torch-neuronx imports, but registers no neuron device or process group.
    monkeypatch.setitem(sys.modules, "torch_neuronx", types.ModuleType("torch_neuronx"))
    with pytest.raises(UsageError, match="registers no neuron device.*use --device xla"):
        NeuronBackend().setup(single_process_env(), "bf16", "tcp")


def test_neuron_without_torch_neuronx_exits_2_with_one_line(tmp_path):
    command = [sys.executable, "-m", "distlm.train", "--device", "neuron", "--bf16", "--no-save", "--max-update", "1"]
    environ = {**os.environ, "PYTHONPATH": str(REPO_ROOT), "DISTLM_CACHE_DIR": str(tmp_path / "cache")}
    proc = subprocess.run(command, cwd=tmp_path, capture_output=True, text=True, timeout=120, env=environ)
    errors = [line for line in proc.stderr.splitlines() if line.startswith("distlm: error:")]
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert len(errors) == 1 and "torch-neuronx" in errors[0], proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr


def neuron_rank_report(sysfs_root: str) -> dict:
    """On one rank of a torchrun-style job: the TorchNeuron backend through the stand-in,
    from setup to an all-reduce over the neuron process group."""
    sys.path.insert(0, str(NEURON_STANDIN))
    import torch_neuronx

    records: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: records.append(record.getMessage())
    logging.getLogger("distlm").addHandler(handler)
    logging.getLogger("distlm").setLevel(logging.INFO)

    env = detect_launch()
    backend = get_backend("neuron")
    backend.sysfs_root = sysfs_root
    backend.setup(env, "bf16", "auto")
    device = backend.device(env)
    backend.init_process_group(env, datetime.timedelta(seconds=60))
    value = torch.tensor([float(env.rank + 1)])
    dist.all_reduce(value)
    with torch.autocast(backend.autocast_device_type, dtype=torch.bfloat16):
        autocast_dtype = torch.get_autocast_dtype("neuron")

    # The tensor-parallel layout's mesh and groups, on the neuron device type.
    dims = ParallelDims(world_size=env.world_size, dp=1, tp=2, strategy="ddp")
    mesh = dims.build_mesh("neuron")
    tp_group = dims.tp_group("neuron")

    os.environ["NEURON_RT_VISIBLE_CORES"] = str(3 - env.local_rank)  # one core per process
    own_core = backend.device(env)
    os.environ["NEURON_RT_VISIBLE_CORES"] = "0-1"
    try:
        backend.device(dataclasses.replace(env, local_world_size=4))
        crowded = ""
    except UsageError as err:
        crowded = str(err)
    return {
        "standin": torch_neuronx.STANDIN,
        "accelerator": str(torch.accelerator.current_accelerator()),
        "device": str(device), "own_core": str(own_core), "crowded": crowded,
        "process_group": dist.get_backend(), "world_size": dist.get_world_size(), "all_reduce": value.item(),
        "mesh": (mesh.device_type, mesh.mesh_dim_names, dist.get_world_size(tp_group), dist.get_backend(tp_group)),
        "autocast_dtype": autocast_dtype,
        "efa": {name: os.environ.get(name) for name in (*EFA_PRESET, *EFA_RDMA_PRESET)},
        "logged": [line for line in records if line.startswith("network efa")],
    }


def test_neuron_backend_on_two_ranks_through_the_stand_in(tmp_path):
    sysfs = fake_sysfs(tmp_path, "rdmap16s27")  # a trn node's EFA device
    ranks = run_distributed(neuron_rank_report, 2, str(sysfs), env={"FI_EFA_USE_HUGE_PAGE": "1"})
    for rank, report in enumerate(ranks):
        assert report["standin"] and report["accelerator"] == "neuron"
        # Four cores visible (NEURON_RT_VISIBLE_CORES unset): local rank r uses core r, as
        # torchrun's LOCAL_RANK assigns it; one visible core is the process's own, index 0.
        assert report["device"] == f"neuron:{rank}" and report["own_core"] == "neuron:0"
        assert "4 ranks on this node but 2 devices visible (NEURON_RT_VISIBLE_CORES=0-1)" in report["crowded"]
        assert report["process_group"] == "neuron" and report["world_size"] == 2
        assert report["mesh"] == ("neuron", ("dp", "tp"), 2, "neuron")
        assert report["all_reduce"] == 1.0 + 2.0
        assert report["autocast_dtype"] == torch.bfloat16
        # The EFA preset with RDMA (Trainium has it); the user's own value survives.
        assert report["efa"] == {**EFA_PRESET, **EFA_RDMA_PRESET, "FI_EFA_USE_HUGE_PAGE": "1"}
    # Logged once, by rank 0, naming what it kept.
    (line,) = ranks[0]["logged"]
    assert "FI_PROVIDER=efa" in line and "kept user values FI_EFA_USE_HUGE_PAGE=1" in line
    assert ranks[1]["logged"] == []


# --------------------------------------------------------------------------- xla rules
#
# Training on torch-xla is tested for real in test_xla.py; these are the refusals that
# need no torch-xla.


def test_xla_refuses_strategies_its_process_group_cannot_run():
    backend = XlaBackend()
    for strategy in ("ddp", "zero1"):
        backend.check_strategy(strategy, tp_degree=1)
    with pytest.raises(UsageError, match="--strategy fsdp is FSDP2.*use --strategy ddp or zero1"):
        backend.check_strategy("fsdp", tp_degree=1)
    with pytest.raises(UsageError, match="--tp-degree 2 is DTensor tensor parallel.*--tp-degree 1"):
        backend.check_strategy("ddp", tp_degree=2)


def test_xla_refuses_fp16_and_points_to_bf16():
    backend = XlaBackend()
    backend.check_precision("bf16")
    with pytest.raises(UsageError, match="--fp16 is not supported on --device xla.*--bf16"):
        backend.check_precision("fp16")


def test_xla_without_torch_xla_says_how_to_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "torch_xla", None)
    with pytest.raises(UsageError, match="needs torch-xla, which is not installed; install torch-xla"):
        XlaBackend().setup(single_process_env(), "bf16", "tcp")
    with pytest.raises(UsageError, match="torch_xla failed to import"):
        XlaBackend().mark_step()


def test_xla_with_several_processes_needs_torchrun():
    with pytest.raises(UsageError, match="needs torchrun"):
        XlaBackend().setup(make_env(world_size=2, port=1234, launcher="slurm"), "bf16", "tcp")


# --------------------------------------------------------------------------- process group start


def test_single_process_group_lets_the_os_pick_the_port():
    env = single_process_env()
    assert env.master_port is None
    CpuBackend().init_process_group(env, datetime.timedelta(seconds=10))
    try:
        value = torch.tensor([2.0])
        dist.all_reduce(value)
        assert dist.get_world_size() == 1 and value.item() == 2.0
    finally:
        dist.destroy_process_group()


def test_a_process_group_other_than_the_launchers_world_is_refused():
    # What torch-xla's xla:// does on XLA's CPU device under torchrun: every process
    # forms a world of its own. Here a real world of 1 is checked against a launch of 2.
    backend = CpuBackend()
    backend.init_process_group(single_process_env(), datetime.timedelta(seconds=10))
    with pytest.raises(DistributedInitError, match="rank 1 of world size 2 .* as rank 0 of 1"):
        backend.check_joined_world(dataclasses.replace(make_env(rank=1), launcher="torchelastic"))
    assert not dist.is_initialized()


def test_missing_master_address_is_a_usage_error():
    env = ClusterEnv(
        rank=0, world_size=2, local_rank=0, local_world_size=1, node_rank=0, num_nodes=2,
        master_addr=None, master_port=None, launcher="mpi",
    )
    with pytest.raises(UsageError, match="resolve_master_via_mpi"):
        CpuBackend().init_process_group(env, datetime.timedelta(seconds=1))


WORKER = textwrap.dedent(
    """
    import datetime
    import torch, torch.distributed as dist
    from distlm.backends import get_backend
    from distlm.launch.detect import detect_launch

    env = detect_launch()
    get_backend("cpu").init_process_group(env, datetime.timedelta(seconds=30))
    value = torch.tensor([float(env.rank + 1)])
    dist.all_reduce(value)
    print(f"RESULT {env.rank} {env.launcher} {dist.get_backend()} {dist.get_world_size()} {value.item()}", flush=True)
    dist.destroy_process_group()
    """
)


def test_two_real_processes_init_through_our_store_and_all_reduce(tmp_path):
    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    port = find_free_port("127.0.0.1")
    world_size = 2
    processes = []
    for rank in range(world_size):
        environ = {
            **os.environ,
            "PYTHONPATH": str(REPO_ROOT),
            "OMP_NUM_THREADS": "1",
            "RANK": str(rank),
            "WORLD_SIZE": str(world_size),
            "LOCAL_RANK": str(rank),
            "LOCAL_WORLD_SIZE": str(world_size),
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port),
            "TORCHELASTIC_RESTART_COUNT": "2",
        }
        processes.append(
            subprocess.Popen([sys.executable, str(script)], env=environ, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        )
    outputs = []
    try:
        for process in processes:
            out, err = process.communicate(timeout=90)
            assert process.returncode == 0, err
            outputs.append(out)
    finally:
        for process in processes:
            if process.poll() is None:
                process.kill()
    expected_sum = float(sum(rank + 1 for rank in range(world_size)))
    for rank, out in enumerate(outputs):
        (line,) = [l for l in out.splitlines() if l.startswith("RESULT")]
        assert line.split()[1:] == [str(rank), "torchelastic", "gloo", str(world_size), str(expected_sum)]


def test_missing_peer_times_out_with_a_clear_message():
    port = find_free_port("127.0.0.1")
    start = time.monotonic()
    with pytest.raises(DistributedTimeout) as info:
        CpuBackend().init_process_group(make_env(rank=0, world_size=2, port=port), datetime.timedelta(seconds=2))
    assert time.monotonic() - start < 20
    message = str(info.value)
    assert "rank 0 of world size 2" in message and f"127.0.0.1:{port}" in message
    assert "1/2" in message  # torch's own count of who arrived, kept in our line
    assert not dist.is_initialized()


def test_missing_master_times_out_on_the_client_side():
    port = find_free_port("127.0.0.1")  # nobody listens here
    with pytest.raises(DistributedTimeout, match=f"rank 1 of world size 2 .*127.0.0.1:{port}"):
        CpuBackend().init_process_group(make_env(rank=1, world_size=2, port=port), datetime.timedelta(seconds=2))


def _cpu_seconds(pid: int) -> float:
    """User plus system CPU time a process has used (Linux /proc)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="reads CPU times from /proc")
def test_cpu_peak_probe_gives_the_same_figure_under_a_competing_load():
    """The log's MFU divides by this probe: a busy machine at start-up must not lower it.
    One spinning process per core of this host competes for every core while the probe
    runs again; its figure does not fall below 60 % of the one measured before.

    The bound is one-sided: a load can only lower a figure read from the wall clock, while
    the frequency governor may raise the clock under load (a loaded figure 25 % above the
    quiet one was seen). 40 % of room covers an SMT sibling sharing the core's FP units."""
    probe = measure_cpu_matmul_flops.__wrapped__  # uncached: measure twice
    quiet = probe("fp32", min_seconds=0.15, threads=1)
    spinners = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(host_cores())]
    try:
        time.sleep(0.1)  # the spinners are running before the probe starts
        loaded = probe("fp32", min_seconds=0.15, threads=1)
        # The load was real: the spinners held the cores during the probe.
        assert sum(_cpu_seconds(spinner.pid) for spinner in spinners) > 0.05
    finally:
        for spinner in spinners:
            spinner.kill()
            spinner.wait()
    assert loaded / quiet >= 0.6, (quiet, loaded)
