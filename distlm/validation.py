"""``validate(config, env, backend)``: everything that can be checked before any rendezvous.

Field-level checks (ranges, value sets) live with the fields in config.py and run when
the command line is parsed. This adds what needs the launch and the hardware: degrees
against the world size, strategy combinations, what the backend can run, and whether
the named architecture fits the layout. Every rank reaches the same verdict from the
same inputs, so bad input ends the job before any rank waits for another.
"""

from __future__ import annotations

import torch

from distlm.backends import Backend
from distlm.builder import resolve_model_spec
from distlm.config import TrainConfig, check_settings
from distlm.env import ClusterEnv
from distlm.errors import UsageError
from distlm.mesh import ParallelDims
from distlm.models.contract import check_model
from distlm.parallel.fsdp import check_cpu_offload
from distlm.parallel.tp import validate_tp

# Any vocabulary will do for shape checks: tensor parallel splits heads and feed-forward
# widths, never requires the vocabulary to divide, and the meta device allocates nothing.
_CHECK_VOCAB_SIZE = 512


def validate(
    config: TrainConfig, env: ClusterEnv, backend: Backend, model: torch.nn.Module | None = None
) -> ParallelDims:
    """UsageError for anything that cannot run; the layout's ``ParallelDims`` otherwise.

    ``model`` is the user's own model, checked against the model contract instead of
    ``--arch``.
    """
    check_settings(config)
    settings = config.distributed
    dims = ParallelDims(world_size=env.world_size, dp=settings.dp_degree, tp=settings.tp_degree, strategy=settings.strategy)
    check_strategy_options(config, dims)
    backend.check_precision(config.precision_mode)
    backend.check_network(settings.network)
    check_cpu_offload(settings.cpu_offload, backend.name)
    if model is not None:
        check_model(model)
        check_model_fits(model, config, dims)
    else:
        check_arch_fits(config, dims)
    return dims


def check_strategy_options(config: TrainConfig, dims: ParallelDims) -> None:
    """Combinations no strategy can run."""
    settings = config.distributed
    hooks_asked = settings.comm_hook != "allreduce" or settings.double_buffering or settings.comm_transport != "torch"
    if settings.strategy == "fsdp" and hooks_asked:
        raise UsageError(
            "--comm-hook/--double-buffering/--comm-transport are DDP communication hooks; "
            "FSDP reduce-scatters its own gradients: use --strategy ddp or zero1, or drop them"
        )
    if settings.cpu_offload and settings.strategy != "fsdp":
        raise UsageError("--cpu-offload is an FSDP option; add --strategy fsdp or drop it")
    if settings.cpu_offload and not dims.dp_enabled:
        raise UsageError(
            "--cpu-offload offloads FSDP's shards, and with one data-parallel rank FSDP is not applied; "
            "drop --cpu-offload or use more data-parallel ranks"
        )
    if hooks_asked and dims.tp_enabled:
        raise UsageError(
            "--comm-hook/--double-buffering/--comm-transport are DDP communication hooks, and DDP cannot hold "
            "tensor-parallel parameters; drop them or use --tp-degree 1"
        )
    if settings.sequence_parallel and not dims.tp_enabled:
        raise UsageError("--sequence-parallel shards along tensor-parallel ranks; set --tp-degree > 1")
    if settings.comm_hook.startswith("hierarchical") and dims.dp_enabled and settings.ranks_per_node is not None:
        if dims.world_size % settings.ranks_per_node:
            raise UsageError(
                f"--ranks-per-node {settings.ranks_per_node} does not divide the world size {dims.world_size}; "
                "give the number of ranks on each node (every node must run as many)"
            )


def check_model_fits(model: torch.nn.Module, config: TrainConfig, dims: ParallelDims, arch: str | None = None) -> None:
    """The model can hold the samples and split over the tensor-parallel degree (a meta model is
    enough). ``arch`` names a built-in architecture in messages; a user's model goes by its class."""
    name = f"--arch {arch}" if arch else type(model).__name__
    if config.data.tokens_per_sample > model.max_positions:
        raise UsageError(
            f"--tokens-per-sample {config.data.tokens_per_sample} exceeds {name}'s "
            f"maximum of {model.max_positions} positions; lower --tokens-per-sample"
        )
    if dims.tp_enabled:
        validate_tp(
            model, dims.tp, sequence_parallel=config.distributed.sequence_parallel,
            tokens_per_sample=config.data.tokens_per_sample, arch=arch,
        )


def check_arch_fits(config: TrainConfig, dims: ParallelDims) -> None:
    """``check_model_fits`` for ``--arch`` or ``--init-from-hf``, before any data or rendezvous."""
    spec = resolve_model_spec(config.model)
    check_model_fits(spec.build(_CHECK_VOCAB_SIZE, 1), config, dims, arch=spec.name)
