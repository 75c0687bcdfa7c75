"""Apply parallelism to a single-device model from outside, in one fixed order.

The order is: pipeline stages (cut from the model's blocks, parallel/pipeline.py), tensor parallel, then compilation of each block, then activation
checkpointing around the compiled blocks, then a mixture of experts' routing pieces and expert parallel (parallel/expert.py),
then FSDP or DDP with its communication hook (``replicate`` when the parameters hold DTensors: tensor or expert parallel).
Each strategy is one ``apply_*`` call in this sequence, never a change to the model
code, and logs one line. ZeRO-1 is the same data parallelism (DDP, or ``replicate``
under tensor parallel) plus a sharded optimizer, which the returned handle builds.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Callable

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

from distlm.backends.base import probe_grouped_mm
from distlm.errors import UsageError
from distlm.layout import Layout
from distlm.mesh import ParallelDims
from distlm.models.contract import model_blocks
from distlm.parallel.compile import apply_compile
from distlm.parallel.ddp import apply_ddp, build_comm_hook
from distlm.parallel.expert import apply_moe, expert_parameters
from distlm.parallel.fsdp import apply_fsdp, fsdp_dtypes
from distlm.parallel.handle import DataParallelHandle
from distlm.parallel.pipeline import cut_stages, parallelize_stages
from distlm.parallel.tp import apply_replicate, apply_tp, shard_gradients_like_parameters
from distlm.precision import MODE_DTYPES
from distlm.state.full import load_full_state_dict
from distlm.state.names import single_device_name

logger = logging.getLogger("distlm")


@dataclass(frozen=True)
class ParallelOptions:
    """How to parallelise: the run's layout, and what precision and the backend add to it."""

    layout: Layout = field(default_factory=Layout)
    """Strategy settings, communication hook, buckets and pipeline (the degrees are the dims')."""
    precision: str = "fp32"
    """fp32 | bf16 | fp16 | memory_efficient_fp16: FSDP's mixed-precision policy follows it."""
    compile_backend: str | None = None
    """Compile each block with this torch.compile backend (inductor, neuron, openxla); None: eager."""
    foreach_clip: bool | None = True
    """foreach value of gradient clipping: None where the device has no foreach kernels (XLA)."""
    grouped_mm: Callable[[torch.device, torch.dtype], tuple[bool, str]] = probe_grouped_mm
    """The backend's verdict on torch._grouped_mm for a mixture of experts (device, compute dtype) -> (runs, why)."""


def parallelize(
    model: nn.Module,
    dims: ParallelDims,
    device: torch.device,
    options: ParallelOptions = ParallelOptions(),
    whole_model: Callable[..., nn.Module] | None = None,
    fill_shards: Callable[[nn.Module], None] | None = None,
) -> tuple[nn.Module, DataParallelHandle]:
    """``model`` parallelised over ``dims``, and the handle the training loop drives it by.

    A model on the meta device is materialised last, shard by shard: from
    ``whole_model()`` (called on rank 0 only; see ``materialise``), or by
    ``fill_shards(model)``, which fills each rank's own shards in place once they are
    allocated (from Hugging Face files, or only the derived buffers when a checkpoint
    will load the parameters).
    """
    mesh = dims.build_mesh(device.type)
    sharded = (dims.strategy == "fsdp" and dims.dp_enabled) or dims.tp_enabled or dims.pp_enabled
    if sharded and whole_model is None and fill_shards is None and dims.world_size > 1:
        # A model built on every rank (the user's own) is cut into shards in place: each
        # rank must hold rank 0's weights first, or the shards would be of different models.
        broadcast_from_rank0(model)
    layout = options.layout
    stages = cut_stages(model, dims, layout.pipeline) if dims.pp_enabled else None
    model = apply_layer_transforms(model, dims, mesh, options)
    if stages is not None:
        return parallelize_stages(stages, dims, device, options, whole_model, fill_shards)
    dtypes = MODE_DTYPES[options.precision]
    expert_gradients = apply_moe(model, dims, device, dtypes.autocast or dtypes.param, options.grouped_mm,
                                 compiled=options.compile_backend is not None)
    # Expert-parallel experts are reduced over their own group (ExpertGradients), never by the dense strategy.
    experts = expert_parameters(model) or None
    double_buffer = None
    fsdp = dims.strategy == "fsdp" and dims.dp_enabled
    if dims.strategy == "fsdp" and not dims.dp_enabled:
        logger.info("--strategy fsdp with one data-parallel rank: nothing to shard, the model stays whole")
    elif fsdp:
        param_dtype, reduce_dtype = fsdp_dtypes(options.precision)
        model = apply_fsdp(model, mesh["dp"], param_dtype=param_dtype, reduce_dtype=reduce_dtype,
                           cpu_offload=layout.cpu_offload, ignored_params=experts)
        logger.info("applied FSDP2 over %d data-parallel ranks (per block and root)", dims.dp)
    elif dims.dp_enabled and (dims.tp_enabled or dims.ep_enabled):
        # torch DDP cannot hold DTensor parameters; replicate (FSDP2's all-reduce twin)
        # averages the tensor-parallel shards' gradients over the dp group as DDP would.
        # Beside expert-parallel DTensors torch DDP fails in backward even when told to
        # ignore them, so the dense parameters take replicate there too.
        model = apply_replicate(model, mesh["dp"], ignored_params=experts)
    elif dims.dp_enabled:  # ddp, and zero1's replicated parameters and gradients
        hook, double_buffer = build_comm_hook(layout, dims, dims.dp_group(device.type), device.type)
        model = apply_ddp(model, device, dims.dp_group(device.type), layout.bucket_cap_mb, hook, double_buffer)
        reducer = double_buffer.reducer if double_buffer is not None else getattr(hook, "reducer", None)
        logger.info(
            "applied DDP over %d replicas, bucket_cap_mb=%g, comm hook %s%s%s%s",
            dims.dp, layout.bucket_cap_mb, layout.comm_hook, f" ({reducer!r})" if reducer is not None else "",
            " over mpi4py" if layout.comm_transport == "mpi" else "",
            " with double buffering (gradients one update stale)" if layout.double_buffering else "",
        )
    elif layout.hooks_asked:
        logger.info("one data-parallel replica: no gradient all-reduce, so the comm hook settings do nothing")
    if whole_model is not None:
        materialise(model, device, whole_model, cpu_offload=layout.cpu_offload)
    elif fill_shards is not None:
        allocate(model, device, cpu_offload=layout.cpu_offload)
        fill_shards(model)
    if (whole_model is not None or fill_shards is not None) and dims.tp_enabled:
        shard_gradients_like_parameters(model)  # apply_tp left them to after materialising
    handle = DataParallelHandle(
        model=model,
        dims=dims,
        dp_group=dims.dp_group(device.type),
        shards_optimizer_state=dims.strategy == "zero1" and dims.dp_enabled,
        double_buffer=double_buffer,
        mixed_precision_by_strategy=fsdp and fsdp_dtypes(options.precision)[0] is not None,
        sync_bucket_mb=layout.bucket_cap_mb,
        foreach_clip=options.foreach_clip,
        expert_gradients=expert_gradients,
    )
    return model, handle


def apply_layer_transforms(model: nn.Module, dims: ParallelDims, mesh, options: ParallelOptions) -> nn.Module:
    """Tensor parallel, then compile of each block, then activation checkpointing around the
    compiled blocks (the other order fails under TP in torch 2.13)."""
    if dims.tp_enabled:
        model = apply_tp(model, mesh["tp"], sequence_parallel=options.layout.sequence_parallel, loss_parallel=True,
                         compiled=options.compile_backend is not None)
    if options.compile_backend is not None:
        apply_compile(model, options.compile_backend)
    if options.layout.activation_checkpointing:
        apply_activation_checkpointing(model)
    return model


@torch.no_grad()
def materialise(
    model: nn.Module, device: torch.device, whole_model: Callable[[], nn.Module], *,
    cpu_offload: bool = Layout.cpu_offload,
) -> None:
    """Allocate this rank's shards of a parallelised meta model and fill them with the
    weights of ``whole_model()``, which only rank 0 calls (collective).

    Rank 0 builds the whole model once, on the host, and broadcasts it; every rank keeps
    only its own shards. Training then starts from exactly the single-process weights
    whatever the layout, which initialising each shard from its own random stream could
    not give. Buffers, including those checkpoints do not carry (Llama's rotary tables),
    are broadcast too: parallelism leaves them whole, in the same order on every rank.
    """
    allocate(model, device, cpu_offload=cpu_offload)
    whole = whole_model() if dist.get_rank() == 0 else None
    load_full_state_dict(model, whole.state_dict() if whole is not None else {}, from_rank0=True)
    buffers = dict(whole.named_buffers()) if whole is not None else {}
    for name, buffer in model.named_buffers():
        if whole is not None:
            buffer.copy_(buffers[single_device_name(name)])
        dist.broadcast(buffer, src=0)
    logger.info("materialised the model shard by shard from rank 0's initialisation")


def allocate(model: nn.Module, device: torch.device, *, cpu_offload: bool = Layout.cpu_offload) -> None:
    """Memory for this rank's shards and the buffers of a parallelised meta model, uninitialised.

    With ``cpu_offload`` FSDP wants its parameter shards on the host (it refuses them on
    the device at the first forward) and the buffers on the device, where compute runs.
    """
    model.to_empty(device=torch.device("cpu") if cpu_offload else device)
    if cpu_offload:
        for module in model.modules():
            for name, buffer in module.named_buffers(recurse=False):
                module._buffers[name] = buffer.to(device)


@torch.no_grad()
def broadcast_from_rank0(model: nn.Module) -> None:
    """Every parameter and buffer of ``model`` as rank 0 holds it (collective)."""
    for tensor in [*model.parameters(), *model.buffers()]:
        dist.broadcast(tensor, src=0)


def apply_activation_checkpointing(model: nn.Module) -> None:
    """Recompute each block's activations in backward (torch's checkpoint wrapper, non-reentrant)."""
    blocks = model_blocks(model)
    if blocks is None:
        raise UsageError(
            f"--activation-checkpointing wraps each of the model's blocks, and {type(model).__name__} declares "
            "no blocks (an nn.ModuleList); drop the flag or declare them"
        )
    for index, block in enumerate(blocks):
        blocks[index] = checkpoint_wrapper(block)
    logger.info("applied activation checkpointing to %d blocks", len(blocks))
