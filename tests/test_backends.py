"""Backends: device choice, precision rules, the EFA preset, Neuron via a stand-in torch_xla,
and the shared process-group start on real gloo processes."""

from __future__ import annotations

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
from distlm.backends import DistributedTimeout, get_backend, resolve_device
from distlm.backends.base import create_store
from distlm.backends.cpu import CpuBackend
from distlm.backends.cuda import (
    EFA_PRESET,
    EFA_RDMA_PRESET,
    CudaBackend,
    apply_env_preset,
    check_cuda_precision,
    configure_network,
    find_efa_devices,
    supports_gpudirect_rdma,
)
from distlm.backends.neuron import NeuronBackend
from distlm.env import ClusterEnv, find_free_port, single_process_env
from distlm.errors import UsageError

REPO_ROOT = Path(distlm.__file__).resolve().parent.parent
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
    assert [get_backend(d).dist_backend for d in ("cpu", "cuda", "neuron")] == ["gloo", "nccl", "xla"]
    assert [get_backend(d).autocast_device_type for d in ("cpu", "cuda", "neuron")] == ["cpu", "cuda", "xla"]


def test_only_cuda_py_names_nccl():
    # A backend is chosen from the device; nothing else may hard-code NCCL.
    sources = [*(REPO_ROOT / "distlm" / "backends").glob("*.py"), REPO_ROOT / "distlm" / "env.py"]
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


# --------------------------------------------------------------------------- neuron stand-in


class FakeXla:
    """A stand-in for torch_xla: records calls; xm.optimizer_step must never be used."""

    def __init__(self, monkeypatch):
        self.calls: list[str] = []
        self.sentinel_device = torch.device("meta")
        torch_xla = types.ModuleType("torch_xla")
        torch_xla.device = lambda: self.sentinel_device
        xla_model = types.ModuleType("torch_xla.core.xla_model")
        xla_model.mark_step = lambda: self.calls.append("mark_step")
        xla_model.wait_device_ops = lambda: self.calls.append("wait_device_ops")
        xla_model.xla_device = lambda: self.sentinel_device

        def optimizer_step(*args, **kwargs):
            raise AssertionError("xm.optimizer_step all-reduces gradients again; must not be called")

        xla_model.optimizer_step = optimizer_step
        backend_module = types.ModuleType("torch_xla.distributed.xla_backend")
        for name, module in {
            "torch_xla": torch_xla,
            "torch_xla.core": types.ModuleType("torch_xla.core"),
            "torch_xla.core.xla_model": xla_model,
            "torch_xla.distributed": types.ModuleType("torch_xla.distributed"),
            "torch_xla.distributed.xla_backend": backend_module,
            "torch_neuronx": types.ModuleType("torch_neuronx"),
        }.items():
            monkeypatch.setitem(sys.modules, name, module)


@pytest.fixture
def fake_xla(monkeypatch):
    return FakeXla(monkeypatch)


def test_neuron_mark_step_and_synchronize_use_torch_xla(fake_xla):
    backend = NeuronBackend()
    backend.mark_step()
    backend.synchronize()
    assert fake_xla.calls == ["mark_step", "wait_device_ops"]
    assert backend.device(single_process_env()) == fake_xla.sentinel_device


def test_neuron_optimizer_step_steps_once_then_cuts_the_graph(fake_xla):
    torch.manual_seed(0)
    weight = torch.nn.Parameter(torch.randn(3))
    weight.grad = torch.randn(3)
    expected = weight.detach() - 0.1 * weight.grad  # plain SGD, computed here
    NeuronBackend().optimizer_step(torch.optim.SGD([weight], lr=0.1))
    torch.testing.assert_close(weight.detach(), expected)
    assert fake_xla.calls == ["mark_step"]


def test_neuron_precision_rules():
    backend = NeuronBackend()
    backend.check_precision("bf16")
    backend.check_precision("fp32")
    for precision in ("fp16", "memory_efficient_fp16"):
        with pytest.raises(UsageError, match="--bf16"):
            backend.check_precision(precision)


def test_neuron_setup_with_stand_in(fake_xla, monkeypatch):
    monkeypatch.delenv("PJRT_DEVICE", raising=False)
    NeuronBackend().setup(single_process_env(), "bf16", "tcp")
    with pytest.raises(UsageError, match="needs torchrun"):
        NeuronBackend().setup(make_env(world_size=2, port=1234, launcher="slurm"), "bf16", "tcp")


def test_neuron_init_process_group_uses_xla_backend(fake_xla, monkeypatch):
    seen = {}
    monkeypatch.setattr(dist, "init_process_group", lambda backend, **kwargs: seen.update(backend=backend, **kwargs))
    NeuronBackend().init_process_group(make_env(port=1234, launcher="torchelastic"), datetime.timedelta(seconds=5))
    assert seen["backend"] == "xla" and seen["init_method"] == "xla://"
    # The "xla" backend exists only once torch_xla.distributed.xla_backend is imported.
    monkeypatch.setitem(sys.modules, "torch_xla.distributed.xla_backend", None)
    with pytest.raises(UsageError, match="torch_xla.distributed.xla_backend"):
        NeuronBackend().init_process_group(make_env(port=1234, launcher="torchelastic"), datetime.timedelta(seconds=5))


def test_neuron_without_torch_xla_says_how_to_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "torch_xla", None)  # makes `import torch_xla` fail
    with pytest.raises(UsageError, match="torch-xla.*pip.repos.neuron.amazonaws.com"):
        NeuronBackend().mark_step()
    with pytest.raises(UsageError, match="torch-xla"):
        NeuronBackend().setup(single_process_env(), "bf16", "tcp")


def test_neuron_without_torch_neuronx_names_it(fake_xla, monkeypatch):
    monkeypatch.setitem(sys.modules, "torch_neuronx", None)
    monkeypatch.delenv("PJRT_DEVICE", raising=False)
    with pytest.raises(UsageError, match="torch-neuronx"):
        NeuronBackend().setup(single_process_env(), "bf16", "tcp")


def test_auto_picks_neuron_when_device_and_packages_exist(fake_xla, tmp_path):
    assert resolve_device("auto", dev_root=tmp_path) == "cpu"  # packages but no /dev/neuron0
    (tmp_path / "neuron0").touch()
    assert resolve_device("auto", dev_root=tmp_path) == "neuron"


# --------------------------------------------------------------------------- process group start


def test_store_is_prefixed_by_restart_count_and_joins_the_agent_store():
    # torchrun's agent already serves the store; rank 0 must connect, not bind again.
    agent = dist.TCPStore("127.0.0.1", 0, 2, is_master=True, wait_for_workers=False)
    agent.set("distlm/restart1/from-agent", "hello")
    env = make_env(rank=0, port=agent.port, launcher="torchelastic")
    environ = {"TORCHELASTIC_USE_AGENT_STORE": "True", "TORCHELASTIC_RESTART_COUNT": "1"}
    store = create_store(env, datetime.timedelta(seconds=5), environ)
    assert store.get("from-agent") == b"hello"
    store.set("from-worker", "hi")
    assert agent.get("distlm/restart1/from-worker") == b"hi"
    assert not agent.check(["from-worker"])  # nothing leaks outside this attempt's prefix


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
    from distlm.env import ClusterEnv

    env = ClusterEnv.detect()
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
