"""The start of a run, in this order: the launcher, validation of every setting before any
rendezvous, the backend's presets, the process group with its heartbeat and the hosts'
placement, and the check that every rank was launched alike (``start_run``)."""

from __future__ import annotations

import datetime
import logging
from dataclasses import dataclass
from pathlib import Path

import torch

from distlm.backends import get_backend
from distlm.config import TrainConfig
from distlm.launch.cluster_env import ExplicitLaunch
from distlm.launch.detect import detect_launch
from distlm.launch.mpi import resolve_master_via_mpi
from distlm.parallel.compile import use_compile_cache
from distlm.runtime.agreement import check_ranks_agree
from distlm.runtime.context import DistContext, describe_layout
from distlm.runtime.process_group import start_process_group
from distlm.runtime.signals import die_with_torchrun_agent
from distlm.training.builder import ModelSpec
from distlm.training.validation import validate_run

logger = logging.getLogger("distlm")


@dataclass(frozen=True)
class Start:
    """What the start of a run found: this process's context and the model validation checked."""

    context: DistContext
    spec: ModelSpec | None
    """The ``--arch``/``--init-from-hf`` model validation checked; None for a user's model."""
    model: torch.nn.Module | None = None
    """The model validation checked, on the meta device: the builder's, where its vocabulary is the run's."""


def start_run(config: TrainConfig, model: torch.nn.Module | None = None, agree: bool = True) -> Start:
    """Launcher, validation, backend presets, process group (heartbeat, hosts), meshes and the
    ranks' agreement, in that order.

    ``model`` is the user's own model, if any, validated in place of ``--arch``. ``agree``:
    refuse ranks launched with different settings or data (a tool whose ranks may differ, such
    as the doctor probing each rank's save dir, passes False). An existing process group (the
    caller's own, or an earlier run's in the same process) is reused.
    """
    settings = config.distributed
    env = detect_launch(
        explicit=ExplicitLaunch(
            world_size=settings.distributed_world_size,
            rank=settings.distributed_rank,
            init_method=settings.distributed_init_method,
        )
    )
    if env.launcher == "mpi" and env.is_distributed:
        env = resolve_master_via_mpi(env)  # mpiexec exports no master address
    if env.launcher == "torchelastic":
        die_with_torchrun_agent()  # also for the tools and the Python API; train.py asked already
    backend = get_backend(settings.device)
    dims, spec, checked = validate_run(config, env, backend, model)
    if config.compile.compile_cache:
        # Before the device runtime starts: XLA's persistent cache and Neuron's compiler
        # read their variables once, when it does.
        use_compile_cache(config.compile.compile_cache, backend.compile_cache_variables)
    backend.setup(env, config.precision_mode, settings.network)
    timeout = datetime.timedelta(seconds=settings.timeout_sec)
    started = start_process_group(env, backend, timeout, Path(config.checkpoint.save_dir) / "comm_traces")
    env, device = started.env, started.device
    context = DistContext(env=env, backend=backend, device=device, dims=dims.on_nodes(started.node_of_rank),
                          timeout=timeout, heartbeat=started.heartbeat)
    if context.is_main:
        # The launcher's line opens the log (fairseq's order), the hosts' findings follow it.
        logger.info("%s; device %s, layout %s, strategy %s", env.describe(), device, describe_layout(context.layout),
                    dims.strategy)
        if started.hosts_line:
            logger.info("%s", started.hosts_line)
    if agree:
        # Before any other collective: ranks launched differently must not reach DDP or the data.
        check_ranks_agree(config, context.all_gather_object)
    return Start(context, spec, checked)
