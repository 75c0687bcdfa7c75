"""What every hardware backend provides, and the process-group start they share.

A backend owns everything that differs between CPU, CUDA, Neuron and XLA devices: the
device a rank uses, the ``torch.distributed`` backend name, which precisions and
strategies the hardware supports, network presets, the ``torch.compile`` backend, and
the step boundaries of lazy devices. The trainer talks only to this interface, so no
other module names NCCL or imports torch_xla or torch_neuronx.
"""

from __future__ import annotations

import datetime
import importlib.util
import os
import sys
from typing import Mapping, MutableMapping

import torch
import torch.distributed as dist

from distlm.backends.attempt_store import StoreWaitTimeout, join_attempt
from distlm.backends.master_probe import check_master_answers
from distlm.choices import NETWORKS, PRECISIONS
from distlm.errors import UsageError, first_line
from distlm.launch.cluster_env import ClusterEnv
from distlm.precision import computes_in_fp16


class DistributedInitError(RuntimeError):
    """The process group could not start; the message names ranks, world size and master."""


class DistributedTimeout(DistributedInitError):
    """A peer never arrived within the timeout (a rank did not start, or cannot reach the master)."""


def check_precision_name(precision: str) -> None:
    if precision not in PRECISIONS:
        raise UsageError(f"precision {precision!r} is not one of {', '.join(PRECISIONS)}")


def refuse_fp16(precision: str, device: str, why: str) -> None:
    """One line refusing ``--fp16``/``--memory-efficient-fp16`` on ``--device device``, pointing to bf16."""
    check_precision_name(precision)
    if computes_in_fp16(precision):
        raise UsageError(f"--{precision.replace('_', '-')} is not supported on --device {device}: {why}; use --bf16 (or fp32)")


def check_network_name(network: str) -> None:
    if network not in NETWORKS:
        raise UsageError(f"--network {network!r} is not one of {', '.join(NETWORKS)}")


def module_importable(name: str) -> bool:
    """Whether ``import name`` would find the module, without importing it (importing
    torch_xla or torch_neuronx starts a device runtime)."""
    if name in sys.modules:
        return sys.modules[name] is not None
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):
        return False


def uses_agent_store(env: ClusterEnv, environ: Mapping[str, str]) -> bool:
    """Under torchrun the agent already serves a TCPStore at MASTER_ADDR:MASTER_PORT."""
    return env.launcher == "torchelastic" and environ.get("TORCHELASTIC_USE_AGENT_STORE", "").lower() == "true"


def create_store(
    env: ClusterEnv,
    timeout: datetime.timedelta,
    environ: Mapping[str, str] | None = None,
) -> dist.Store:
    """The rendezvous store for ``init_process_group``, built here rather than by ``env://``.

    Rank 0 serves a TCPStore at the master address. Under torchrun, whose agent already
    serves one there, rank 0 serves its own on a port the OS picks and announces it in
    the agent's (distlm/backends/attempt_store.py says why: the agent's store outlives restarts).
    """
    environ = os.environ if environ is None else environ
    if env.master_addr is None:
        raise UsageError(
            f"launcher {env.launcher} gives no master address: export MASTER_ADDR and MASTER_PORT, "
            "or call distlm.launch.mpi.resolve_master_via_mpi() first (needs mpi4py)"
        )
    port = env.master_port
    if port is None:
        if env.world_size > 1:
            raise UsageError(f"launcher {env.launcher} gives no master port: export MASTER_PORT")
        port = 0  # one process: the OS picks a port that is free, no guessing
    if uses_agent_store(env, environ):
        try:
            return join_attempt(env.master_addr, port, env.rank, env.world_size, timeout, environ)
        except StoreWaitTimeout as err:
            raise DistributedTimeout(f"{_where(env, port)}: {err}") from err
        except (dist.DistError, RuntimeError) as err:
            raise describe_init_failure(err, env, port, timeout, "the rendezvous store") from err
    is_master = env.rank == 0
    if not is_master:
        check_master_answers(env.master_addr, port, env.rank, timeout.total_seconds())
    try:
        store = dist.TCPStore(
            env.master_addr,
            port,
            env.world_size,
            is_master=is_master,
            timeout=timeout,
            # The master's constructor blocks until every rank has connected, so a
            # missing rank surfaces here as one clear timeout.
            wait_for_workers=True,
        )
    except (dist.DistError, RuntimeError) as err:
        raise describe_init_failure(err, env, port, timeout, "the rendezvous store") from err
    return store


def _where(env: ClusterEnv, port: int) -> str:
    return f"rank {env.rank} of world size {env.world_size} (launcher {env.launcher}, master {env.master_addr}:{port})"


def describe_init_failure(
    err: BaseException, env: ClusterEnv, port: int, timeout: datetime.timedelta, stage: str
) -> DistributedInitError:
    cause = first_line(err)
    timed_out = "time" in cause.lower()  # "Timed out", "timed out", "timeout"
    where = _where(env, port)
    if timed_out:
        return DistributedTimeout(
            f"{where} gave up on {stage} after {timeout.total_seconds():g} s: {cause}. "
            f"Check that all {env.world_size} ranks started and can reach {env.master_addr}:{port}."
        )
    return DistributedInitError(f"{where} could not set up {stage}: {cause}")


def probe_grouped_mm(device: torch.device, dtype: torch.dtype) -> tuple[bool, str]:
    """Whether ``torch._grouped_mm`` runs forward and backward on ``device`` in ``dtype``, and why (or why not)."""
    where = f"{device.type} in {str(dtype).removeprefix('torch.')}"
    if not hasattr(torch, "_grouped_mm"):
        return False, f"torch {torch.__version__} has no torch._grouped_mm"
    try:
        x = torch.ones(8, 16, device=device, dtype=dtype, requires_grad=True)
        w = torch.ones(2, 16, 16, device=device, dtype=dtype, requires_grad=True)
        y = torch._grouped_mm(x, w.transpose(-2, -1), offs=torch.tensor([3, 8], dtype=torch.int32, device=device))
        # A gradient of its own: an expanded one (stride 0) fails the CPU backward in torch 2.13,
        # which the experts never receive (theirs comes out of the routing weights' product).
        y.backward(torch.ones(y.shape, device=device, dtype=dtype))
    except (RuntimeError, NotImplementedError, TypeError) as err:
        return False, f"torch._grouped_mm fails on {where} ({first_line(err)})"
    return True, f"torch._grouped_mm runs on {where}, forward and backward"


class Backend:
    """One kind of hardware. Subclasses set ``name``, ``dist_backend`` and ``autocast_device_type``."""

    name: str = ""
    dist_backend: str = ""
    compile_backend: str = "inductor"
    """The ``torch.compile`` backend that compiles for this hardware."""
    static_shapes: bool = False
    """Graphs are traced per input shape (XLA): batches are padded to one length."""
    compile_cache_variables: dict[str, str] = {"TORCHINDUCTOR_CACHE_DIR": "inductor"}
    """Environment variables that place the compiler's caches, each under a sub-directory
    of ``--compile-cache``."""
    foreach_clip: bool | None = True
    """``foreach`` for ``torch.nn.utils.clip_grad_norm_``: torch's multi-tensor kernels,
    unless the device refuses them (None lets torch choose)."""

    @property
    def autocast_device_type(self) -> str:
        """The ``device_type`` for ``torch.autocast`` on this hardware."""
        raise NotImplementedError

    def device(self, env: ClusterEnv) -> torch.device:
        raise NotImplementedError

    def check_precision(self, precision: str) -> None:
        """UsageError if this hardware cannot train in ``precision``."""
        check_precision_name(precision)

    def check_network(self, network: str) -> None:
        check_network_name(network)

    def check_strategy(self, strategy: str, tp_degree: int) -> None:
        """UsageError if this hardware cannot run ``--strategy`` with ``--tp-degree``; every
        strategy runs wherever torch.distributed's FSDP2 and DTensor do."""

    def setup(self, env: ClusterEnv, precision: str, network: str = "auto") -> None:
        """Validate the request against the hardware and apply presets; before any process group."""
        self.check_precision(precision)
        self.check_network(network)

    def record_collectives(self, dump_dir: str, environ: MutableMapping[str, str] | None = None) -> dict[str, str]:
        """Keep a record of recent collectives, dumped to ``dump_dir`` when one times out;
        returns the variables set. Only NCCL has such a flight recorder."""
        return {}

    def init_process_group(self, env: ClusterEnv, timeout: datetime.timedelta) -> None:
        store = create_store(env, timeout)
        try:
            dist.init_process_group(
                self.dist_backend, store=store, rank=env.rank, world_size=env.world_size, timeout=timeout
            )
        except (dist.DistError, RuntimeError) as err:
            raise describe_init_failure(err, env, env.master_port or 0, timeout, "the process group") from err
        self.check_joined_world(env)

    def check_joined_world(self, env: ClusterEnv) -> None:
        """DistributedInitError unless the process group has this rank where the launcher put it.

        A backend that finds rank and world size itself (torch-xla's ``xla://``) can form a
        world other than the launcher's; every rank then trains alone, silently.
        """
        rank, world_size = dist.get_rank(), dist.get_world_size()
        if (rank, world_size) == (env.rank, env.world_size):
            return
        dist.destroy_process_group()
        raise DistributedInitError(
            f"rank {env.rank} of world size {env.world_size} (launcher {env.launcher}) joined the "
            f"{self.dist_backend} process group as rank {rank} of {world_size}: the {self.name} runtime "
            "does not see the other processes of this job"
        )

    def grouped_mm(self, device: torch.device, dtype: torch.dtype) -> tuple[bool, str]:
        """Whether a mixture of experts runs its experts as one ``torch._grouped_mm`` here in
        ``dtype`` (else a loop over experts), and why: the kernel exists for some devices and
        dtypes only, so it is tried once, forward and backward, on a tiny problem."""
        if self.static_shapes:
            return False, f"a traced {self.name} device compiles the loop's per-expert shapes, not the grouped kernel"
        return probe_grouped_mm(device, dtype)

    def mark_step(self) -> None:
        """End of a traced step; only lazy (XLA) devices need one."""

    def optimizer_step(self, optimizer: torch.optim.Optimizer) -> None:
        optimizer.step()

    def synchronize(self) -> None:
        """Wait for queued device work (for timing); eager CPU has none."""

    def __repr__(self) -> str:
        return f"{type(self).__name__}(name={self.name!r}, dist_backend={self.dist_backend!r})"
