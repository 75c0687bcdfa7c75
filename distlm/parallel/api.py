"""Apply parallelism to a single-device model from outside, in one fixed order.

The order is: tensor parallel, then activation checkpointing, then FSDP or DDP with its
communication hook (``replicate`` when the parameters are tensor-parallel DTensors).
Each strategy is one ``apply_*`` call in this sequence, never a change to the model
code, and logs one line. ZeRO-1 is the same data parallelism (DDP, or ``replicate``
under tensor parallel) plus a sharded optimizer, which the trainer builds after this.
"""

from __future__ import annotations

import contextlib
import logging
from typing import Any, Callable, Iterator

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from distlm.config import DistributedConfig
from distlm.errors import UsageError
from distlm.mesh import ParallelDims
from distlm.parallel.ddp import apply_ddp

logger = logging.getLogger("distlm")


def parallelize(
    model: torch.nn.Module,
    dims: ParallelDims,
    cfg: DistributedConfig,
    device: torch.device,
    comm_hook: tuple[Callable, Any] | None = None,
    precision_mode: str = "fp32",
    whole_model: Callable[[], torch.nn.Module] | None = None,
) -> torch.nn.Module:
    """``model`` parallelised over ``dims``. A model on the meta device is materialised
    last, shard by shard, from ``whole_model()`` (called on rank 0 only); see ``materialise``."""
    mesh = dims.build_mesh(device.type)
    if dims.tp_enabled:
        from distlm.parallel.tp import apply_tp

        model = apply_tp(model, mesh["tp"], sequence_parallel=cfg.sequence_parallel, loss_parallel=True)
    if cfg.activation_checkpointing:
        apply_activation_checkpointing(model)
        logger.info("applied activation checkpointing to %d blocks", len(model.layers))
    if cfg.strategy == "fsdp" and not dims.dp_enabled:
        logger.info("--strategy fsdp with one data-parallel rank: nothing to shard, the model stays whole")
    elif cfg.strategy == "fsdp":
        from distlm.parallel.fsdp import apply_fsdp, fsdp_dtypes

        param_dtype, reduce_dtype = fsdp_dtypes(precision_mode)
        model = apply_fsdp(model, mesh["dp"], param_dtype=param_dtype, reduce_dtype=reduce_dtype,
                           cpu_offload=cfg.cpu_offload)
        logger.info("applied FSDP2 over %d data-parallel ranks (per block and root)", dims.dp)
    elif dims.dp_enabled and dims.tp_enabled:
        # torch DDP cannot hold DTensor parameters; replicate (FSDP2's all-reduce twin)
        # averages the tensor-parallel shards' gradients over the dp group as DDP would.
        from distlm.parallel.tp import apply_replicate

        model = apply_replicate(model, mesh["dp"])
    elif dims.dp_enabled:  # ddp, and zero1's replicated parameters and gradients
        model = apply_ddp(model, device, dims.dp_group(device.type), cfg.bucket_cap_mb, comm_hook)
        logger.info(
            "applied DDP over %d replicas, bucket_cap_mb=%g, comm hook %s%s%s",
            dims.dp, cfg.bucket_cap_mb, cfg.comm_hook,
            " over mpi4py" if cfg.comm_transport == "mpi" else "",
            " with double buffering (gradients one update stale)" if cfg.double_buffering else "",
        )
    if whole_model is not None:
        materialise(model, device, whole_model, cpu_offload=cfg.cpu_offload)
        if dims.tp_enabled:
            from distlm.parallel.tp import shard_gradients_like_parameters

            shard_gradients_like_parameters(model)  # apply_tp left them to after materialising
    return model


@torch.no_grad()
def materialise(
    model: torch.nn.Module, device: torch.device, whole_model: Callable[[], torch.nn.Module], *, cpu_offload: bool = False
) -> None:
    """Allocate this rank's shards of a parallelised meta model and fill them with the
    weights of ``whole_model()``, which only rank 0 calls (collective).

    Rank 0 builds the whole model once, on the host, and broadcasts it; every rank keeps
    only its own shards. Training then starts from exactly the single-process weights
    whatever the layout, which initialising each shard from its own random stream could
    not give. Buffers, including those checkpoints do not carry (Llama's rotary tables),
    are broadcast too: parallelism leaves them whole, in the same order on every rank.
    With ``cpu_offload`` FSDP wants its parameter shards on the host (it refuses them on
    the device at the first forward) and the buffers on the device, where compute runs.
    """
    from distlm import checkpoint

    model.to_empty(device=torch.device("cpu") if cpu_offload else device)
    if cpu_offload:
        for module in model.modules():
            for name, buffer in module.named_buffers(recurse=False):
                module._buffers[name] = buffer.to(device)
    whole = whole_model() if dist.get_rank() == 0 else None
    checkpoint.load_full_state_dict(model, whole.state_dict() if whole is not None else {}, from_rank0=True)
    buffers = dict(whole.named_buffers()) if whole is not None else {}
    for name, buffer in model.named_buffers():
        if whole is not None:
            buffer.copy_(buffers[checkpoint.single_device_name(name)])
        dist.broadcast(buffer, src=0)
    logger.info("materialised the model shard by shard from rank 0's initialisation")


def apply_activation_checkpointing(model: torch.nn.Module) -> None:
    """Recompute each block's activations in backward (torch's checkpoint wrapper, non-reentrant)."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    if not isinstance(getattr(model, "layers", None), torch.nn.ModuleList):
        raise UsageError(
            f"--activation-checkpointing wraps each block of model.layers, and {type(model).__name__} has no "
            "nn.ModuleList named layers; drop the flag or keep the model's blocks there"
        )
    for index, block in enumerate(model.layers):
        model.layers[index] = checkpoint_wrapper(block)


@contextlib.contextmanager
def gradient_sync(model: torch.nn.Module, enabled: bool) -> Iterator[None]:
    """Synchronise gradients in this backward or not (DDP's no_sync, FSDP2's requires_gradient_sync)."""
    if hasattr(model, "set_requires_gradient_sync"):  # FSDP2 and replicate
        model.set_requires_gradient_sync(enabled)
        yield
    elif not enabled and isinstance(model, DistributedDataParallel):
        with model.no_sync():
            yield
    else:
        yield


def check_strategy(cfg: DistributedConfig, dims: ParallelDims) -> None:
    """Combinations no strategy can run, refused before anything starts."""
    hooks_asked = cfg.comm_hook != "allreduce" or cfg.double_buffering or cfg.comm_transport != "torch"
    if cfg.strategy == "fsdp" and hooks_asked:
        raise UsageError(
            "--comm-hook/--double-buffering/--comm-transport are DDP communication hooks; "
            "FSDP reduce-scatters its own gradients: use --strategy ddp or zero1, or drop them"
        )
    if cfg.cpu_offload and cfg.strategy != "fsdp":
        raise UsageError("--cpu-offload is an FSDP option; add --strategy fsdp or drop it")
    if cfg.cpu_offload and not dims.dp_enabled:
        raise UsageError(
            "--cpu-offload offloads FSDP's shards, and with one data-parallel rank FSDP is not applied; "
            "drop --cpu-offload or use more data-parallel ranks"
        )
    if hooks_asked and cfg.tp_degree > 1:
        raise UsageError(
            "--comm-hook/--double-buffering/--comm-transport are DDP communication hooks, and DDP cannot hold "
            "tensor-parallel parameters; drop them or use --tp-degree 1"
        )
    if cfg.sequence_parallel and cfg.tp_degree == 1:
        raise UsageError("--sequence-parallel shards along tensor-parallel ranks; set --tp-degree > 1")


def build_comm_hook(
    cfg: DistributedConfig, dims: ParallelDims, ranks_per_node: int, device_type: str
) -> tuple[Callable, Any] | None:
    """The DDP communication hook for --comm-hook/--comm-transport/--double-buffering, or None.

    None means DDP's built-in C++ all-reduce, which is exactly ``allreduce`` over the
    process group; every other choice is a Python hook from parallel/comm_hooks.py.
    """
    if cfg.comm_hook == "allreduce" and cfg.comm_transport == "torch" and not cfg.double_buffering:
        return None
    from distlm.parallel import comm_hooks
    transport_factory = None
    if cfg.comm_transport == "mpi":
        from distlm.parallel.mpi_transport import mpi_transport_factory

        transport_factory = mpi_transport_factory(device_type)
    reducer = comm_hooks.build_reducer(
        cfg.comm_hook,
        dims.dp_group(device_type),
        ranks_per_node=ranks_per_node,
        device_type=device_type,
        inter_transport_factory=transport_factory,
    )
    if cfg.double_buffering:
        return comm_hooks.double_buffered_hook(reducer)
    return comm_hooks.ddp_hook(reducer), None


def unwrap(model: torch.nn.Module) -> torch.nn.Module:
    """The user's single-device module inside any wrappers (names in checkpoints stay stable)."""
    while True:
        if isinstance(model, DistributedDataParallel):
            model = model.module
        elif isinstance(model, torch._dynamo.eval_frame.OptimizedModule):
            model = model._orig_mod
        else:
            return model
