"""Tensor parallel (and sequence parallel) driven by the model's declared ``tp_plan``.

Models declare, as data, how their modules split (``tp_plan``: a module-name pattern,
``*`` standing for a layer index, mapped to a style name). This module translates the
styles into torch's own ``parallelize_module`` styles; it never rewrites model code.

=====================  =========================================================  ==============================
plan style             without --sequence-parallel                                with --sequence-parallel
=====================  =========================================================  ==============================
``colwise``            ColwiseParallel: weight rows (output features) sharded     input all-gathered from sequence
                       (Q/K/V, fc1, w1/w3); output stays sharded (local heads)    shards unless its parent is a
                                                                                  ``sequence_gather`` module
``colwise_kv``         ``colwise`` for key/value projections; a degree that is    as ``colwise``
                       a multiple of the model's key/value heads replicates
                       each head over degree / heads ranks (below)
``rowwise``            RowwiseParallel: weight columns sharded (out, fc2, w2);    reduce-scatter onto sequence
                       partial outputs all-reduced                                shards instead of all-reduce
``vocab_embedding``    RowwiseParallel on an embedding: vocabulary rows sharded,  output reduce-scattered onto
                       rows outside a rank's range give 0, outputs all-reduced    sequence shards
``colwise_output``     ColwiseParallel on the output projection; with             input all-gathered from
                       loss_parallel its logits stay sharded on the vocabulary    sequence shards
``sequence_norm``      left alone (replicated; every TP rank computes it)         SequenceParallel: runs on the
                                                                                  rank's sequence shard
``sequence_gather``    left alone                                                 PrepareModuleInput: the first
                                                                                  input is all-gathered once for
                                                                                  all ``colwise`` children
``head_norm``          SequenceParallel on dimension 2: a per-head norm (Qwen3's  as without
                       query/key norms) on the rank's local heads [B, T, H, d],
                       weight replicated, its gradient summed over the tp ranks
``sequence_region``    left alone                                                 a ModuleList of blocks that run
                                                                                  on sequence shards: the sequence
                                                                                  is split before the first block
                                                                                  and gathered after the last
=====================  =========================================================  ==============================

Sequence parallel needs the sequence length divisible by the tp degree. Batches are
padded on the right with the pad token to the next multiple, and per-position logits are
cut back. Neither distlm model lets a right pad reach a real position (RoBERTa masks
padded keys, Llama is causal), so only rounding changes.

A vocabulary that the tp degree does not divide is sharded unevenly (``torch.chunk``
sizes, e.g. 131 + 130 rows for the 261-symbol byte vocabulary on 2 ranks). DTensor's
vocabulary-parallel embedding and loss handle uneven shards (tested), so nothing is
padded and nothing is refused: parameter shapes and single-device numerics stay as they are.

Tensor parallel wider than the key/value heads (grouped-query attention, e.g. Llama 3's
8 heads at TP 16 or 32): the degree must still divide the query heads, and each rank's
query heads then read one key/value head, which ``degree / kv_heads`` consecutive ranks
share. Each of those ranks holds that head (Megatron's and NxD's layout), but the
parameter stays the single-device tensor: a DTensor on the tp mesh unflattened into
(heads, replicas), placed (Shard(0), Replicate()), so state dicts, checkpoints and
exports hold each head once. The replicas' gradients differ (each comes from other
query heads) and the head's gradient is their sum, all-reduced over the replicas.

Dropout: wherever activations are replicated across the TP ranks of a replica (without
--sequence-parallel the whole residual stream; RoBERTa's embedding block always), all of
them must draw the same mask, or their copies drift apart (tests/test_tp.py shows both).
So the torch RNG must be seeded by data-parallel rank, alike on the TP ranks of a
replica. Inside sharded regions (local heads, sequence shards) that seed then repeats
one mask pattern on different heads or tokens: correlated but unbiased. Megatron's
separate tensor-parallel RNG stream avoids that; DTensor's RNG tracker offers it only for
random ops on DTensors on CUDA-like meshes, and distlm's dropouts act on local tensors.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import inspect
import logging
import math
import re
from typing import Any, Iterable

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed._composable.replicate_with_fsdp import replicate
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    PrepareModuleOutput,
    RowwiseParallel,
    SequenceParallel,
    loss_parallel,
    parallelize_module,
)

from distlm.errors import UsageError
from distlm.layout import Layout
from distlm.models.contract import model_blocks, model_tp_plan

logger = logging.getLogger("distlm")

STYLES = (
    "colwise",
    "colwise_kv",
    "rowwise",
    "vocab_embedding",
    "colwise_output",
    "sequence_norm",
    "sequence_gather",
    "sequence_region",
    "head_norm",
)

# Attribute set on a tensor-parallel model; read by loss_context() and the trainer.
_TP_INFO = "_distlm_tp"


@dataclasses.dataclass(frozen=True)
class TPInfo:
    degree: int
    sequence_parallel: bool
    loss_parallel: bool
    """True when the logits come out as a DTensor sharded on the vocabulary."""


# ------------------------------------------------------------------ validation


def validate_tp(
    model: nn.Module,
    tp_degree: int,
    *,
    sequence_parallel: bool = Layout.sequence_parallel,
    tokens_per_sample: int | None = None,
    arch: str | None = None,
) -> None:
    """UsageError unless ``tp_degree`` splits every dimension the model's plan shards.

    ``model``: a model of the distlm model contract (one on the meta device is enough).
    ``arch`` only names the model in the message. The vocabulary is not
    checked: uneven vocabulary shards are supported (see the module docstring). With
    ``sequence_parallel``, ``tokens_per_sample`` padded up to a multiple of the degree
    must still fit the model's positions.
    """
    if tp_degree < 1:
        raise UsageError(f"--tp-degree must be at least 1, got {tp_degree}")
    if tp_degree == 1:
        return
    model_class, config = type(model), getattr(model, "config", None)
    name = f"--arch {arch}" if arch else model_class.__name__
    plan = model_tp_plan(model)
    if not plan:
        raise UsageError(
            f"--tp-degree {tp_degree}: {name} declares no tp_plan, so it cannot be tensor-parallel; use --tp-degree 1"
        )
    unknown = sorted(set(plan.values()) - set(STYLES))
    if unknown:
        raise UsageError(f"--tp-degree {tp_degree}: {name}'s tp_plan uses unknown styles {unknown}; known: {', '.join(STYLES)}")
    heads = kv_heads(model)
    if heads is not None and heads % tp_degree and tp_degree % heads:
        raise UsageError(
            f"--tp-degree {tp_degree} neither divides nor is a multiple of n_kv_heads {heads} of {name}; "
            f"choose a divisor or a multiple of {heads}"
        )
    for field in getattr(model, "tp_divisible", ()) if config is not None else ():
        value = getattr(config, field)
        if value % tp_degree:
            shown = _FIELD_NAMES.get(field, field)
            raise UsageError(f"--tp-degree {tp_degree} does not divide {shown} {value} of {name}")
    if sequence_parallel and tokens_per_sample is not None:
        positions = model.max_positions
        padded = -(-tokens_per_sample // tp_degree) * tp_degree
        if padded > positions:
            raise UsageError(
                f"--sequence-parallel pads --tokens-per-sample {tokens_per_sample} to {padded}, a multiple of "
                f"--tp-degree {tp_degree}, beyond the {positions} positions of {name}; lower --tokens-per-sample"
            )


# Config fields shown under the name users know them by.
_FIELD_NAMES = {"kv_heads": "n_kv_heads"}


def kv_heads(model: nn.Module) -> int | None:
    """How many heads the model's ``colwise_kv`` projections hold (its ``tp_kv_heads``
    config field), or None when it declares none."""
    field, config = getattr(model, "tp_kv_heads", None), getattr(model, "config", None)
    return None if field is None or config is None else getattr(config, field)


# ---------------------------------------------------------------- application


def _pattern_regex(pattern: str) -> re.Pattern:
    return re.compile(re.escape(pattern).replace(r"\*", r"\d+") + "$")


def _resolve(model: nn.Module, plan: dict[str, str]) -> dict[str, str]:
    """Module name -> style, every pattern expanded against the real module tree."""
    names = [name for name, _ in model.named_modules() if name]
    resolved: dict[str, str] = {}
    for pattern, style in plan.items():
        regex = _pattern_regex(pattern)
        matched = [name for name in names if regex.match(name)]
        if not matched:
            raise UsageError(f"--tp-degree: tp_plan entry {pattern!r} of {type(model).__name__} matches no module; "
                             "fix the model's tp_plan")
        for name in matched:
            resolved[name] = style
    return resolved


def _positional_arity(module: nn.Module) -> int:
    params = inspect.signature(module.forward).parameters.values()
    return sum(p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD) for p in params)


def _parent(name: str) -> str:
    return name.rpartition(".")[0]


def _styles(
    model: nn.Module, resolved: dict[str, str], sequence_parallel: bool, loss_parallel: bool,
    heads_mesh: DeviceMesh | None = None,
) -> tuple[dict[str, Any], list[tuple[str, Any]]]:
    """The torch parallel style for each module name (for parallelize_module), and
    (name, style) pairs to apply after it. ``heads_mesh``: the (heads, replicas) mesh
    when the degree exceeds the key/value heads."""
    sp = sequence_parallel
    stream = Shard(1) if sp else Replicate()  # layout of the residual stream between blocks
    gathered = {name for name, style in resolved.items() if style == "sequence_gather"}
    plan: dict[str, Any] = {}
    later: list[tuple[str, Any]] = []
    for name, style in resolved.items():
        if style in ("colwise", "colwise_kv"):
            # Under SP a colwise layer gathers its own input unless its parent did it
            # once for all its colwise children.
            own_gather = sp and _parent(name) not in gathered
            layouts = {"input_layouts": Shard(1)} if own_gather else {}
            if style == "colwise_kv" and heads_mesh is not None:
                plan[name] = ColwiseOverHeadReplicas(heads_mesh, **layouts)
            else:
                plan[name] = ColwiseParallel(**layouts)
        elif style == "rowwise":
            plan[name] = RowwiseParallel(output_layouts=stream)
        elif style == "vocab_embedding":
            plan[name] = RowwiseParallel(input_layouts=Replicate(), output_layouts=stream)
        elif style == "colwise_output":
            plan[name] = ColwiseParallel(
                input_layouts=stream,
                output_layouts=Shard(-1) if loss_parallel else Replicate(),
                use_local_output=not loss_parallel,
            )
        elif style == "head_norm":
            # Each rank normalises other heads with the same weight, whose true gradient is the
            # sum of theirs: the heads dimension read as a shard makes DTensor sum it.
            plan[name] = SequenceParallel(sequence_dim=2, use_local_output=True)
        elif not sp:
            continue  # the remaining styles only matter for sequence parallel
        elif style == "sequence_norm":
            # Local outputs keep the residual stream a plain tensor (sequence shard), so
            # residual adds never mix DTensor and Tensor.
            plan[name] = SequenceParallel(use_local_output=True)
        elif style == "sequence_gather":
            rest = (None,) * (_positional_arity(model.get_submodule(name)) - 1)
            # The gathered input stays a DTensor: the gradients of all colwise children
            # then sum as partials and leave through a single reduce-scatter.
            plan[name] = PrepareModuleInput(input_layouts=(Shard(1), *rest), desired_input_layouts=(Replicate(), *rest))
        elif style == "sequence_region":
            blocks = model.get_submodule(name)
            if not isinstance(blocks, nn.ModuleList) or len(blocks) == 0:
                raise UsageError(f"--sequence-parallel: tp_plan's sequence_region {name!r} of {type(model).__name__} "
                                 "must be a non-empty ModuleList; fix the model's tp_plan")
            rest = (None,) * (_positional_arity(blocks[0]) - 1)
            # By key, not position: a pipeline stage keeps its blocks' single-device indices.
            first, last = next(iter(blocks._modules)), list(blocks._modules)[-1]
            # Replicate -> Shard is a local slice (its backward an all-gather).
            plan[f"{name}.{first}"] = PrepareModuleInput(
                input_layouts=(Replicate(), *rest), desired_input_layouts=(Shard(1), *rest), use_local_output=True
            )
            # The last block may also be the first, so its output side is applied in a
            # second pass (a plan holds one style per module).
            later.append((f"{name}.{last}", PrepareModuleOutput(
                output_layouts=Shard(1), desired_output_layouts=Replicate(), use_local_output=True
            )))
    return plan, later


def apply_tp(model: nn.Module, tp_mesh: DeviceMesh, *, sequence_parallel: bool, loss_parallel: bool,
             compiled: bool = False) -> nn.Module:
    """Tensor-parallelise ``model`` in place over the 1-D ``tp_mesh``; returns it.

    Call before activation checkpointing and FSDP/DDP, on a model whose weights are
    already initialised identically on all ranks, or on the meta device (then
    ``parallel.api.materialise`` fills the shards afterwards). Parameters covered by the plan become
    DTensors; all others stay plain tensors, replicated and computed alike on every TP
    rank. ``loss_parallel`` is honoured only where the plan has a ``colwise_output``
    (Llama); RoBERTa's head is tied to a replicated embedding, so its logits stay whole.
    Check ``tp_info(model).loss_parallel`` and compute the loss in ``loss_context(model)``.
    ``compiled``: the blocks will be compiled, which needs the embedding's output to own
    its storage (``_own_storage``); eager runs skip that copy.
    """
    degree = tp_mesh.size()
    validate_tp(model, degree)
    resolved = _resolve(model, model_tp_plan(model))
    loss_parallel = loss_parallel and "colwise_output" in resolved.values()
    heads = kv_heads(model)
    heads_mesh = None
    if heads is not None and degree > heads and "colwise_kv" in resolved.values():
        heads_mesh = tp_mesh._unflatten(0, (heads, degree // heads), HEADS_MESH_DIMS)
    styles, later = _styles(model, resolved, sequence_parallel, loss_parallel, heads_mesh)
    parallelize_module(model, tp_mesh, styles)
    for name, style in later:
        parallelize_module(model.get_submodule(name), tp_mesh, style)
    if compiled:
        for name, style in resolved.items():
            if style == "vocab_embedding":
                model.get_submodule(name).register_forward_hook(_own_storage)
    if sequence_parallel:
        _pad_sequence_to_multiple(model, degree)
    if not any(param.is_meta for param in model.parameters()):
        # A meta model gets them once materialised: to_empty swaps the parameters'
        # tensors, and hooks registered before it no longer fire (torch 2.13).
        shard_gradients_like_parameters(model)
    info = TPInfo(degree=degree, sequence_parallel=sequence_parallel, loss_parallel=loss_parallel)
    setattr(model, _TP_INFO, info)
    logger.info(
        "applied tensor parallel over %d ranks (%d modules sharded%s%s%s)",
        degree,
        sum(style in ("colwise", "colwise_kv", "rowwise", "vocab_embedding", "colwise_output")
            for style in resolved.values()),
        ", sequence parallel" if sequence_parallel else "",
        ", loss parallel" if loss_parallel else "",
        f", each of {heads} key/value heads on {degree // heads} ranks" if heads_mesh is not None else "",
    )
    return model


# Names of the tp mesh unflattened into (key/value heads, replicas of each head).
HEADS_MESH_DIMS = ("tp_kv", "tp_kv_replica")


class ColwiseOverHeadReplicas(ColwiseParallel):
    """ColwiseParallel for a key/value projection over more ranks than it has heads.

    Consecutive tp ranks share a head (those whose query heads read it). The weight is
    distributed on ``heads_mesh`` as (Shard(0), Replicate()): global shape unchanged,
    each rank holding its head's rows. In forward those rows are viewed as the rank's
    Shard(0) of all ranks' rows stacked on the tp mesh, so the layer computes, and its
    input's gradient leaves, exactly as a ``colwise`` layer's. The local weight gradient
    goes back Partial over the replicas, and redistributing it to the parameter's layout
    (the hook of ``shard_gradients_like_parameters``, or FSDP/replicate) sums it there.
    """

    def __init__(self, heads_mesh: DeviceMesh, *, input_layouts=None) -> None:
        super().__init__(input_layouts=input_layouts)
        self.heads_mesh = heads_mesh

    def _partition_linear_fn(self, name: str, module: nn.Module, device_mesh: DeviceMesh) -> None:
        for param_name, param in module.named_parameters():
            placed = distribute_tensor(param, self.heads_mesh, [Shard(0), Replicate()], src_data_rank=self.src_data_rank)
            module.register_parameter(param_name, nn.Parameter(placed, requires_grad=param.requires_grad))

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        if not isinstance(module, nn.Linear):
            raise UsageError(f"--tp-degree: tp_plan style colwise_kv needs an nn.Linear, got {type(module).__name__}; "
                             "fix the model's tp_plan")
        module.forward = functools.partial(_linear_over_head_replicas, module, device_mesh)
        return super()._apply(module, device_mesh)


def _linear_over_head_replicas(module: nn.Linear, tp_mesh: DeviceMesh, x: DTensor) -> DTensor:
    bias = None if module.bias is None else _stacked_replicas(module.bias, tp_mesh)
    return F.linear(x, _stacked_replicas(module.weight, tp_mesh), bias)


def _stacked_replicas(param: DTensor, tp_mesh: DeviceMesh) -> DTensor:
    """The rank's rows of ``param`` as its Shard(0) of every tp rank's rows stacked (replicas repeated)."""
    local = param.to_local(grad_placements=(Shard(0), Partial()))
    shape = (local.shape[0] * tp_mesh.size(), *local.shape[1:])
    stride = tuple(math.prod(shape[i + 1:]) for i in range(len(shape)))
    return DTensor.from_local(local, tp_mesh, (Shard(0),), run_check=False, shape=shape, stride=stride)


def _own_storage(module: nn.Module, args, output: torch.Tensor) -> torch.Tensor:
    """The embedding's output as a tensor of its own rather than a view of the DTensor's
    local tensor. A compiled block taking that view as input hands its gradient past the
    view's DTensor conversion in backward (torch 2.13: "'Tensor' object has no attribute
    '_local_tensor'"); one copy of [B, T, D] per forward avoids it."""
    return output.clone()


def shard_gradients_like_parameters(model: nn.Module) -> None:
    """Hand each sharded parameter its gradient in the parameter's own layout.

    DTensor has no row-wise rule for the embedding backward: the vocabulary-parallel
    embedding's gradient comes out Replicate, the whole [V, dim] table on every TP rank,
    and would stay that size until the optimizer step (llama3_8b: 2 GiB per rank in
    fp32). Replicate -> Shard is a local slice, so the hook costs no communication. FSDP
    and replicate install parameters of their own and lay out gradients themselves.
    Tensor hooks do not survive ``to_empty``: on a meta model call this after materialising.
    """
    for param in model.parameters():
        if isinstance(param, DTensor) and any(placement.is_shard() for placement in param.placements):
            param.register_hook(functools.partial(_redistribute_like, param.device_mesh, tuple(param.placements)))


def _redistribute_like(mesh: DeviceMesh, placements: tuple, grad: torch.Tensor) -> torch.Tensor:
    if isinstance(grad, DTensor) and tuple(grad.placements) != placements:
        return grad.redistribute(mesh, placements)
    return grad


def _pad_sequence_to_multiple(model: nn.Module, multiple: int) -> None:
    """Right-pad ``input_ids`` (and the masked positions) to a multiple of the tp degree, and
    cut per-position logits back, so sequence shards are always even.

    The model's masked-LM arguments are passed by keyword (``masked_tokens``: a boolean
    mask; ``masked_positions``: flat indices, renumbered for the longer rows), as are a
    causal LM's ``document_ids`` (padded as a document of its own), and ``has_padding``
    becomes true when padding was added.
    """
    pad = model.padding_idx
    lengths: list[int] = []

    def pad_inputs(module, args, kwargs):
        input_ids = args[0] if args else kwargs["input_ids"]
        length = input_ids.shape[1]
        extra = -length % multiple
        lengths.append(length if extra else -1)
        if not extra:
            return None
        kwargs = dict(kwargs)
        padded = nn.functional.pad(input_ids, (0, extra), value=pad)
        if args:
            args = (padded, *args[1:])
        else:
            kwargs["input_ids"] = padded
        if kwargs.get("masked_tokens") is not None:
            kwargs["masked_tokens"] = nn.functional.pad(kwargs["masked_tokens"], (0, extra), value=False)
        if kwargs.get("document_ids") is not None:
            # The padding is a document of its own (-1), as the data pads, so no real token sees it.
            kwargs["document_ids"] = nn.functional.pad(kwargs["document_ids"], (0, extra), value=-1)
        if kwargs.get("masked_positions") is not None:
            positions = kwargs["masked_positions"]
            kwargs["masked_positions"] = positions // length * (length + extra) + positions % length
        if "has_padding" in kwargs:
            kwargs["has_padding"] = True
        return args, kwargs

    def cut_outputs(module, args, kwargs, output):
        length = lengths.pop()
        if length < 0 or kwargs.get("masked_tokens") is not None or kwargs.get("masked_positions") is not None:
            return None  # masked-token logits are [n_masked, V]: padding added no rows
        return output[:, :length]

    model.register_forward_pre_hook(pad_inputs, with_kwargs=True)
    model.register_forward_hook(cut_outputs, with_kwargs=True)


# ------------------------------------------------------------ training helpers


def tp_info(model: nn.Module) -> TPInfo | None:
    """What apply_tp did to ``model`` (looks through DDP/compile wrappers), or None."""
    seen = model
    for _ in range(4):
        info = getattr(seen, _TP_INFO, None)
        if info is not None:
            return info
        seen = getattr(seen, "module", None) or getattr(seen, "_orig_mod", None)
        if seen is None:
            return None
    return None


def loss_context(model: nn.Module):
    """Compute the loss *and call backward* inside this: ``loss_parallel()`` when the
    model's logits are sharded on the vocabulary, else a no-op."""
    info = tp_info(model)
    return loss_parallel() if info is not None and info.loss_parallel else contextlib.nullcontext()


def local_value(tensor: torch.Tensor) -> torch.Tensor:
    """A plain tensor of a (replicated) DTensor result such as the parallel loss."""
    return tensor.full_tensor() if isinstance(tensor, DTensor) else tensor


def clip_grad_norm_(parameters: Iterable[torch.Tensor], max_norm: float, foreach: bool | None = True, *,
                    group: dist.ProcessGroup | None = None,
                    uncounted: Iterable[torch.Tensor] = ()) -> torch.Tensor:
    """Global gradient norm (a plain tensor) over DTensor and plain gradients, clipped to ``max_norm``.

    Sharded DTensor gradients count each shard once (torch reduces over the mesh);
    plain and replicated gradients are identical on every TP rank and count once.
    ``group``: ranks holding the model's other parameters (the pipeline's stages), whose
    squared norms are added in; ``uncounted``: parameters clipped but left out of the norm,
    as a copy of a tied weight that another stage counts.
    """
    # torch's clip_grad_norm_ stacks the per-tensor norms, which fails when they live
    # on different meshes (TP DTensors next to plain or FSDP-only parameters); group by
    # mesh, reduce each group to a plain number, then combine.
    meshes: dict[Any, list[torch.Tensor]] = {}
    device = None
    for p in parameters:
        device = p.device if device is None else device
        if p.grad is not None:
            meshes.setdefault(p.grad.device_mesh if isinstance(p.grad, DTensor) else None, []).append(p)
    skipped = {id(p) for p in uncounted}
    squares = torch.zeros((), dtype=torch.float32, device=device)
    for members in meshes.values():
        grads = [p.grad for p in members if id(p) not in skipped]
        if grads:
            squares = squares + local_value(torch.nn.utils.get_total_norm(grads, 2.0, foreach=foreach)).float() ** 2
    if group is not None:
        dist.all_reduce(squares, group=group)
    total = squares.sqrt()
    if math.isfinite(max_norm):
        for members in meshes.values():
            torch.nn.utils.clip_grads_with_norm_(members, max_norm, total, foreach=foreach)
    return total


def apply_replicate(model: nn.Module, dp_mesh: DeviceMesh, ignored_params: set[nn.Parameter] | None = None
                    ) -> nn.Module:
    """Data parallelism (replicated parameters, averaged gradients) for a tensor-parallel model.

    torch's DistributedDataParallel cannot hold DTensor parameters: given the dp process
    group it fails at once (its initial broadcast, and with init_sync=False its reducer,
    mix Tensor and DTensor). Given ``device_mesh=`` it swaps them for local
    tensors, trains correctly, but the module loses its registered parameters after the
    first forward (llama_tiny: 39 -> 0), so state_dict() and parameters() break. torch's
    FSDP2-based ``replicate`` keeps them DTensors on the (dp, tp) mesh, so clipping,
    state dicts and distributed checkpoints work as for FSDP. It is applied per block,
    then to the root, so gradient all-reduces overlap backward (torchtitan's layout).
    Gradients are averaged over dp, as DDP does; on non-final micro-batches call
    ``model.set_requires_gradient_sync(False)`` (DDP's ``no_sync``). ``ignored_params``
    (expert parallelism's experts) are left alone: neither replicated nor reduced.
    """
    for block in model_blocks(model) or ():
        replicate(block, mesh=dp_mesh, ignored_params=ignored_params)
    replicate(model, mesh=dp_mesh, ignored_params=ignored_params)
    logger.info("applied replicate over %d data-parallel ranks (%s)", dp_mesh.size(),
                "beside the experts' DTensors" if ignored_params else "tensor-parallel parameters")
    return model
