"""Mixture-of-experts layers over ranks: expert parallelism, and routing statistics of the global batch.

``apply_moe`` installs, into each MoE layer of a model built single-device
(distlm/models/moe/model.py):

- how its experts compute: one ``torch._grouped_mm`` where the backend runs it in the
  run's compute dtype, forward and backward, else a loop over experts (the start-up log
  says which, and why);
- with data parallelism, ``reduce_statistics``: the routing counts and router
  probabilities of each micro-batch summed over the data-parallel ranks (one all-reduce
  per MoE layer and micro-batch, on a process group of its own so that it never
  interleaves with the gradient reductions), so that the auxiliary loss, the bias update
  and the log see the global batch, as one process would;
- with ``--ep-degree N``, expert parallelism. The data-parallel ranks form groups of N
  consecutive ranks (``ParallelDims.ep_mesh``); the ranks of a group split each MoE
  layer's experts, ``E / N`` each, as DTensors sharded along the expert dimension of the
  single-device tensors, so checkpoints hold them under their single-device names and
  reshard to any degree. A layer's forward sends each of its tokens to the rank holding
  its expert and the results back with ``all_to_all_single`` (uneven splits,
  differentiable: ``torch.distributed._functional_collectives``, the successor of
  ``torch.distributed.nn.functional``'s), on the ``ep`` group. Dense parameters keep the
  run's strategy over all data-parallel ranks (FSDP, or for ddp FSDP2's all-reduce twin
  ``replicate``: torch DDP fails in backward beside DTensor parameters even when told
  to ignore them). The experts' gradients are left out of it and reduced by
  ``ExpertGradients`` over the ranks holding the same experts.

Under tensor parallel the attention and dense feed-forward layers split over the
tensor-parallel ranks (the family's ``tp_plan``), and each MoE layer (router, shared
and routed experts) is replicated over them: without sequence parallel the residual
stream is replicated there, so every tensor-parallel rank of a replica holds the same
tokens. The expert-parallel groups are carved from the data-parallel ranks of one
tensor-parallel place (``ParallelDims.ep_mesh``), as torchtitan and Megatron carve them
from data parallel: each place routes each of its replica's tokens once, within its own
group, and no group sees a token twice. Spanning the tensor-parallel ranks instead
(torchtitan's borrowing of TP ranks) needs the tokens split over them, i.e. sequence
parallel, which a mixture of experts refuses here. The places compute the same expert
gradients, so those are still summed over ``ep_replica`` alone, and the routing
statistics over the data-parallel ranks of one place (``statistics_group``).
"""

from __future__ import annotations

import functools
import logging
from typing import Callable

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard

from distlm.backends.base import probe_grouped_mm
from distlm.errors import UsageError
from distlm.layout import Layout
from distlm.mesh import ParallelDims
from distlm.models.moe.model import MoEFeedForward, moe_layers
from distlm.state.names import local_shard

logger = logging.getLogger("distlm")


def check_expert_parallel(model: nn.Module, dims: ParallelDims, name: str,
                          sequence_parallel: bool = Layout.sequence_parallel) -> None:
    """UsageError for a layout the model's experts cannot take (a meta model is enough),
    before any rendezvous."""
    layers = moe_layers(model)
    if layers and sequence_parallel:
        # The MoE layers route the replica's whole batch on every tensor-parallel rank (module
        # docstring); sequence shards would need the experts' groups to span those ranks.
        raise UsageError(f"--sequence-parallel with a mixture of experts ({name}) is not offered: its MoE layers "
                         "take the replicated activations of plain tensor parallel; drop --sequence-parallel")
    if not dims.ep_enabled:
        return
    if not layers:
        raise UsageError(f"--ep-degree {dims.ep} splits the experts of MoE layers, and {name} has none; drop "
                         "--ep-degree or train a mixture of experts (e.g. --arch qwen3_moe_tiny)")
    if dims.tp_enabled and dims.pp_enabled:
        raise UsageError(f"--ep-degree {dims.ep} with both --tp-degree {dims.tp} and --pp-degree {dims.pp} is not "
                         "offered (each of them is, with expert parallel); drop one")
    experts = layers[0].n_experts
    if experts % dims.ep:
        raise UsageError(f"--ep-degree {dims.ep} does not divide the {experts} experts of each MoE layer of {name}; "
                         f"choose a divisor of {experts}")


class ExpertParallelDispatch:
    """An MoE layer's ``dispatch`` under expert parallelism: tokens (sorted by expert) to the
    ranks of the ``ep`` group holding their experts, through the local experts, and back."""

    def __init__(self, group: dist.ProcessGroup, degree: int) -> None:
        self.group, self.degree = group, degree

    def __call__(self, routed: torch.Tensor, counts: torch.Tensor, experts: nn.Module) -> torch.Tensor:
        degree = self.degree
        local = counts.numel() // degree
        # Rank s learns how many tokens each rank sends to each of its experts: [source, local expert].
        received = torch.empty_like(counts)
        dist.all_to_all_single(received, counts, group=self.group)
        splits = torch.cat([counts.view(degree, local).sum(1), received.view(degree, local).sum(1)]).tolist()
        send, receive = splits[:degree], splits[degree:]
        tokens = funcol.all_to_all_single_autograd(routed, receive, send, self.group)
        # Rows arrive by source rank, then by expert; the experts want them by expert.
        expert_of_row = torch.arange(local, device=counts.device).repeat(degree).repeat_interleave(received)
        order = expert_of_row.argsort(stable=True)
        out = experts(tokens[order], received.view(degree, local).sum(0))
        return funcol.all_to_all_single_autograd(out[order.argsort()], send, receive, self.group)


class ExpertGradients:
    """The experts' gradients made those of one process: summed over the ranks holding the same
    experts (``ep_replica`` group) and divided by the data-parallel degree, since each rank's
    loss was scaled by it for the average the dense parameters take (distlm/training/step.py).
    Called once an update, after the last micro-batch's backward."""

    def __init__(self, params: list[nn.Parameter], group: dist.ProcessGroup | None, dp: int) -> None:
        self.params, self.group, self.dp = params, group, dp

    @torch.no_grad()
    def reduce(self) -> None:
        grads = [local_shard(p.grad) for p in self.params if p.grad is not None]
        if not grads:
            return
        if self.group is not None:
            flat = torch.cat([g.reshape(-1) for g in grads])  # one collective for every expert
            dist.all_reduce(flat, group=self.group)
            torch._foreach_copy_(grads, [part.view_as(g) for part, g in zip(flat.split([g.numel() for g in grads]),
                                                                             grads)])
        torch._foreach_div_(grads, float(self.dp))


def apply_moe(model: nn.Module, dims: ParallelDims, device: torch.device, compute_dtype: torch.dtype,
              grouped_mm: Callable[[torch.device, torch.dtype], tuple[bool, str]] = probe_grouped_mm,
              compiled: bool = False) -> ExpertGradients | None:
    """Install the pieces of the module docstring into ``model``'s MoE layers (collective: every
    rank calls it). ``grouped_mm(device, compute_dtype)``: the backend's verdict on
    torch._grouped_mm, and why; ``compiled``: the blocks run under torch.compile. Returns what
    reduces the experts' gradients under expert parallelism (None otherwise)."""
    layers = moe_layers(model)
    if not layers:
        return None
    if compiled and compute_dtype != torch.bfloat16:
        # Measured on CPU: eager runs it in float32, the compiled graph fails at the first forward.
        use_grouped, why = False, ("torch.compile traces torch._grouped_mm with a kernel that takes bfloat16 only "
                                   f"(torch {torch.__version__}), and this run computes in "
                                   f"{str(compute_dtype).removeprefix('torch.')}")
    else:
        use_grouped, why = grouped_mm(device, compute_dtype)
    for layer in layers:
        layer.experts.grouped_mm = use_grouped
    logger.info("mixture of experts: %d MoE layers of %d experts, top-%d, dropless; experts run %s (%s)",
                len(layers), layers[0].n_experts, layers[0].top_k,
                "as one grouped GEMM" if use_grouped else "in a loop over experts", why)
    if dims.tp_enabled:
        logger.info("mixture of experts under tensor parallel: each MoE layer's router and experts whole on each of "
                    "the %d tensor-parallel ranks, which route the same tokens (no sequence parallel)%s", dims.tp,
                    "; expert parallel within the data-parallel ranks of each tensor-parallel place"
                    if dims.ep_enabled else "")
    if dims.dp_enabled:
        group = statistics_group(dims)
        for layer in layers:
            layer.reduce_statistics = functools.partial(dist.all_reduce, group=group)
    if not dims.ep_enabled:
        return None
    mesh = dims.ep_mesh(device.type)
    params = shard_experts(layers, mesh["ep"])
    dispatch = ExpertParallelDispatch(mesh["ep"].get_group(), dims.ep)
    for layer in layers:
        layer.dispatch = dispatch
    replicas = mesh["ep_replica"].get_group() if dims.ep_replicas > 1 else None
    logger.info("applied expert parallel over groups of %d ranks: %d of %d experts per rank in each MoE layer, %s",
                dims.ep, layers[0].n_experts // dims.ep, layers[0].n_experts,
                f"their gradients summed over the {dims.ep_replicas} ranks holding the same experts"
                if dims.ep_replicas > 1 else "each expert on one rank")
    return ExpertGradients(params, replicas, dims.dp)


def statistics_group(dims: ParallelDims) -> dist.ProcessGroup:
    """This rank's data-parallel peers (``ParallelDims.dp_peers``) as a group of its own
    (collective: every rank creates every group, as new_group requires). Tensor-parallel
    ranks of a replica route the same tokens and pipeline stages hold other layers, so
    the statistics of one MoE layer's global batch are the sum over these ranks alone."""
    rank, mine = dist.get_rank(), None
    for first in range(dims.world_size):
        peers = dims.dp_peers(first)
        if peers[0] == first:  # each group once, in the same order on every rank
            group = dist.new_group(ranks=peers)
            if rank in peers:
                mine = group
    return mine


def routing_over_stages(routing: dict, group: dist.ProcessGroup, device: torch.device) -> dict:
    """``finish_update``'s numbers of this pipeline stage's MoE layers ({} where it holds none)
    made the whole model's on every rank of ``group`` (the pipeline, collective): the aux
    losses summed over the stages' layers, as one process sums them over its layers, the
    worst layer's load imbalance, the dropped tokens summed."""
    keys = ("aux_loss", "load_imbalance", "dropped_tokens")
    mine = torch.tensor([float(bool(routing)), *(float(routing.get(key, 0)) for key in keys)],
                        dtype=torch.float64, device=device)
    gathered = [torch.empty_like(mine) for _ in range(dist.get_world_size(group))]
    dist.all_gather(gathered, mine, group=group)
    stages = [row for row in torch.stack(gathered).tolist() if row[0] > 0]
    if not stages:
        return {}
    return {"aux_loss": sum(row[1] for row in stages), "load_imbalance": max(row[2] for row in stages),
            "dropped_tokens": int(sum(row[3] for row in stages))}


def shard_experts(layers: list[MoEFeedForward], mesh: DeviceMesh) -> list[nn.Parameter]:
    """Each layer's expert tensors as DTensors sharded along the experts over ``mesh`` (the
    ``ep`` group), this rank keeping its own block of experts; returns the new parameters.
    A meta model stays on meta (its shards are allocated and filled after parallelising)."""
    rank, degree = mesh.get_local_rank(), mesh.size()
    params = []
    for experts in (layer.experts for layer in layers):
        for name, param in list(experts.named_parameters(recurse=False)):
            per_rank = param.shape[0] // degree
            mine = param.detach()[rank * per_rank:(rank + 1) * per_rank]
            local = mine if mine.is_meta else mine.clone()  # its own storage: the whole tensor is freed
            sharded = DTensor.from_local(local, mesh, [Shard(0)], run_check=False, shape=param.shape,
                                         stride=param.stride())
            new = nn.Parameter(sharded, requires_grad=param.requires_grad)
            setattr(experts, name, new)
            params.append(new)
    return params


def expert_parameters(model: nn.Module) -> set[nn.Parameter]:
    """The parameters expert parallelism holds (left out of the dense strategy's wrapping)."""
    return {p for layer in moe_layers(model) for p in layer.experts.parameters() if isinstance(p, DTensor)}
