"""Fully sharded data parallel through torch's FSDP2 (``fully_shard``).

Every transformer block in ``model.blocks`` becomes one FSDP unit and the root takes
the rest (embeddings, final norm, LM head). Each unit's parameters are all-gathered in
one collective before its forward and backward, and its gradients reduce-scattered in
one collective after its backward, so parameters, gradients and optimizer state are
all sharded across the data-parallel mesh (ZeRO stage 3).

Gradients are averaged over the data-parallel group, exactly as DDP averages them
(FSDP2 reduce-scatters with ``ReduceOp.AVG``, always in fp32 here: see ``fsdp_dtypes``).
The trainer's loss factor (dp degree / global target tokens) therefore needs no change.

Checkpoints hold these shards as they are (each rank writes and reads its own), under
the single-device parameter names, whatever strategy wrote them.
"""

from __future__ import annotations

import warnings

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard

from distlm.errors import UsageError
from distlm.layout import Layout
from distlm.models.contract import model_blocks
from distlm.precision import MODE_DTYPES

# Devices whose memory FSDP's CPUOffloadPolicy can offload from. On anything else the
# policy has nothing to offload and torch fails at the first forward with
# "Cannot access accelerator device when none is available" (measured on CPU).
_OFFLOADABLE_DEVICES = ("cuda",)


def check_cpu_offload(cpu_offload: bool, device_type: str) -> None:
    """Refuse ``--cpu-offload`` where FSDP cannot run it; call before any process group starts.

    ``device_type`` is the resolved device (``cpu``, ``cuda``, ``neuron``); ``auto``
    is resolved here the way the backends resolve it.
    """
    if not cpu_offload:
        return
    if device_type == "auto":
        device_type = "cuda" if torch.cuda.is_available() else "cpu"
    if device_type not in _OFFLOADABLE_DEVICES:
        raise UsageError(
            f"--cpu-offload moves FSDP's parameters and gradients off an accelerator, but --device is "
            f"{device_type} (FSDP's CPUOffloadPolicy fails without CUDA); drop --cpu-offload"
        )


def fsdp_dtypes(precision_mode: str) -> tuple[torch.dtype | None, torch.dtype | None]:
    """``(param_dtype, reduce_dtype)`` for apply_fsdp from distlm's precision mode: compute
    in the autocast type, reduce as the precision table says (``precision.MODE_DTYPES``);
    the sharded master weights keep the mode's parameter type."""
    dtypes = MODE_DTYPES[precision_mode]
    return dtypes.autocast, dtypes.fsdp_reduce


def apply_fsdp(
    model: nn.Module,
    dp_mesh: DeviceMesh,
    *,
    param_dtype: torch.dtype | None,
    reduce_dtype: torch.dtype | None,
    reshard_after_forward: bool = True,
    cpu_offload: bool = Layout.cpu_offload,
    ignored_params: set[nn.Parameter] | None = None,
) -> nn.Module:
    """Shard ``model`` in place over the 1-D ``dp_mesh`` and return it.

    ``model.blocks`` (a ModuleList) gives the FSDP units. Parameters may
    already be DTensors on a tensor-parallel mesh (2-D FSDP + TP): FSDP2 then shards
    them further over ``dp_mesh``, which must be a sibling of that mesh. ``ignored_params``
    (expert parallelism's experts) are left alone: neither sharded nor reduced.
    """
    if dp_mesh.ndim != 1:
        raise ValueError(f"apply_fsdp wants the 1-D data-parallel mesh, got a {dp_mesh.ndim}-D mesh")
    layers = model_blocks(model)
    if layers is None:
        raise UsageError(
            f"--strategy fsdp shards per transformer block, but {type(model).__name__} declares no "
            "blocks (an nn.ModuleList); use --strategy ddp for this model"
        )
    _check_ties_stay_in_one_unit(model, layers)
    mp_policy = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype)
    offload_policy = CPUOffloadPolicy() if cpu_offload else OffloadPolicy()
    for index, layer in enumerate(layers):
        # The last block is all-gathered again right away when backward starts, so
        # freeing it after forward would only add one all-gather (torchtitan does the same).
        last = index == len(layers) - 1
        fully_shard(
            layer,
            mesh=dp_mesh,
            reshard_after_forward=reshard_after_forward and not last,
            mp_policy=mp_policy,
            offload_policy=offload_policy,
            ignored_params=ignored_params,
        )
    # The root keeps its parameters after forward (FSDP2's default for the root):
    # the LM head's backward needs them first.
    fully_shard(model, mesh=dp_mesh, mp_policy=mp_policy, offload_policy=offload_policy, ignored_params=ignored_params)
    # FSDP2 warns when the root returns a view (F.linear on [B, T, D] returns the logits
    # as one), because an in-place op on it would skip the pre-backward hook. The
    # trainer only reads the logits out of place, so the warning is noise on every rank.
    warnings.filterwarnings("ignore", message=r"FSDP2-wrapped module .* returned a view tensor")
    return model


def _check_ties_stay_in_one_unit(model: nn.Module, layers: nn.ModuleList) -> None:
    """A parameter shared by two FSDP units would be sharded twice and silently untied.

    Ties inside one unit are fine (RoBERTa's LM head projects onto
    ``embed_tokens.weight``, both in the root unit).
    """
    owner: dict[int, str] = {}
    for index, layer in enumerate(layers):
        for name, param in layer.named_parameters(remove_duplicate=False):
            unit = f"layers.{index}"
            if owner.setdefault(id(param), unit) != unit:
                raise UsageError(
                    f"--strategy fsdp: parameter {unit}.{name} is tied to one in {owner[id(param)]}; "
                    "FSDP shards each block separately, so tied weights must live in one block or "
                    "outside model.blocks; use --strategy ddp"
                )
    layer_params = set(owner)
    layer_ids = {id(m) for layer in layers for m in layer.modules()}
    for module_name, module in model.named_modules():
        if id(module) in layer_ids:
            continue
        for name, param in module.named_parameters(recurse=False, remove_duplicate=False):
            if id(param) in layer_params:
                raise UsageError(
                    f"--strategy fsdp: parameter {module_name}.{name} is tied to one in {owner[id(param)]}; "
                    "FSDP shards each block separately, so tied weights must live in one block or "
                    "outside model.blocks; use --strategy ddp"
                )
