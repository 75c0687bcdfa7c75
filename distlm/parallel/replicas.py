"""Debug check that every copy of a parameter is bit-identical (``--check-replicas``).

Copies live on the ranks of the data-parallel group (unless FSDP shards it, by design)
and, for whatever tensor parallel leaves whole (norms, RoBERTa's embeddings, replicated
DTensors), on the ranks of the tensor-parallel group; a key/value head replicated over
tp ranks (tp wider than the heads) on the ranks sharing it.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from distlm.mesh import ParallelDims
from distlm.parallel.tp import HEADS_MESH_DIMS
from distlm.state.names import parameter_names


class ReplicaDrift(RuntimeError):
    """Copies of a parameter differ: a bug in a strategy or a hardware fault; one line naming it."""


def check_replicas(model: nn.Module, ctx, update: int) -> None:
    """RuntimeError on every rank if any copy of any parameter differs (collective over the world).

    A drift is seen only inside the group holding it; every rank must stop together, or
    the others would wait for it in the next collective until the timeout. ``ctx`` is
    the run's ``distlm.runtime.context.DistContext``.
    """
    drift = first_replica_drift(model, ctx.dims, ctx.device.type)
    if ctx.any_rank(drift is not None) and drift is None:
        drift = "parameters differ between replicas on other ranks (their errors name them)"
    if drift is not None:
        raise ReplicaDrift(f"--check-replicas: after update {update}, {drift}")


@torch.no_grad()
def first_replica_drift(model: nn.Module, dims: ParallelDims, device_type: str) -> str | None:
    """Which parameter differs between which ranks of this rank's groups; None if all agree
    (collective over the data-parallel and tensor-parallel groups)."""
    params = list(model.parameters())
    names = parameter_names(model)
    drifts = []
    # Expert parallel's experts differ across their group by design: their copies are the
    # ranks holding the same experts.
    experts = [i for i, p in enumerate(params) if _sharded_on(p, "ep")]
    if dims.dp_enabled and dims.replicas_share_parameters:
        dense = [i for i in range(len(params)) if i not in set(experts)]
        drifts.append(_first_difference([params[i] for i in dense], [names[i] for i in dense],
                                        dims.dp_group(device_type), "data-parallel"))
    if experts and dims.ep_replicas > 1:
        drifts.append(_first_difference([params[i] for i in experts], [names[i] for i in experts],
                                        dims.ep_mesh(device_type)["ep_replica"].get_group(), "expert replica"))
    if dims.tp_enabled:
        heads, replicas = HEADS_MESH_DIMS
        whole = [i for i, p in enumerate(params) if not _sharded_on(p, "tp") and not _sharded_on(p, heads)]
        drifts.append(_first_difference([params[i] for i in whole], [names[i] for i in whole],
                                        dims.tp_group(device_type), "tensor-parallel"))
        # Key/value heads replicated over tp ranks (tp wider than the heads): the copies of a head.
        shared = [i for i, p in enumerate(params) if _sharded_on(p, heads)]
        if shared:
            drifts.append(_first_difference([params[i] for i in shared], [names[i] for i in shared],
                                            params[shared[0]].device_mesh.get_group(replicas), "key/value head replica"))
    return next((d for d in drifts if d is not None), None)


def _sharded_on(param: torch.Tensor, mesh_dim: str) -> bool:
    """Whether a (DTensor) parameter is split along the named mesh dimension."""
    if not isinstance(param, DTensor):
        return False
    names = param.device_mesh.mesh_dim_names or ()
    return mesh_dim in names and param.placements[names.index(mesh_dim)].is_shard()


def _first_difference(params: list[torch.Tensor], names: list[str], group, kind: str) -> str | None:
    """Which parameter's local tensor differs across ``group``, and between which ranks;
    None if all copies are bit-identical (collective over ``group``)."""
    if not params:
        return None
    mine = torch.stack([_bitwise_digest(p) for p in params]).cpu()
    gathered = [torch.empty_like(mine) for _ in range(dist.get_world_size(group))]
    dist.all_gather(gathered, mine, group=group)
    ranks = dist.get_process_group_ranks(group)
    for rank, theirs in zip(ranks, gathered):
        differs = (theirs != gathered[0]).any(dim=1).nonzero()
        if len(differs):
            return f"parameter {names[int(differs[0])]} differs between {kind} ranks {ranks[0]} and {rank}"
    return None


def _bitwise_digest(tensor: torch.Tensor) -> torch.Tensor:
    """Two int64 checksums of the tensor's bits: their plain sum and a position-weighted sum.

    Comparing bits (not float sums) catches differences that cancel numerically, and
    the weights catch elements that merely swapped places.
    """
    if isinstance(tensor, DTensor):
        tensor = tensor.to_local()  # tensor-parallel shards: compared with the same shard of other replicas
    flat = tensor.detach().contiguous().view(-1)
    word = torch.int32 if flat.element_size() == 4 else torch.int16 if flat.element_size() == 2 else torch.int64
    bits = flat.view(word).to(torch.int64)
    weights = torch.arange(1, bits.numel() + 1, dtype=torch.int64, device=bits.device)
    return torch.stack([bits.sum(), (bits * weights).sum()])
