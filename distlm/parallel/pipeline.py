"""Pipeline parallelism: stages cut from the single-device model along its blocks, run by
torch.distributed.pipelining's schedules (GPipe, 1F1B, interleaved 1F1B, zero bubble, ZBV).

Each rank keeps the single-device model with only its own blocks (under their single-device
names, ``layers.5`` stays ``layers.5``), the embedding if it runs the first stage, and the
final norm and head if it runs the last. The model's forward is split by the contract's
``embed``, ``block_args`` and ``head``; a ``StageChunk`` runs one stage's part of it and is
what DDP or FSDP wraps and what a ``PipelineStage`` drives. The optimizer, clipping and
checkpoints see the pruned model, so checkpoints keep the names of every other layout.

Between stages travel the residual stream and the input ids, with document masking also
the document ids (each stage recomputes the blocks' extra inputs, such as an attention mask
or restarted rotary positions, from the ids). A tied embedding lives on
the first and the last stage, one copy each, equal at the start; their gradients are summed
between the two after every update's backward (Megatron's embedding group), so the copies
stay bit-identical. The loss exists on the last stage; its sum is reduced over the pipeline
so every rank logs, validates and checks the same number.

A mixture of experts' MoE layers (distlm/parallel/expert.py) run in their stages: each
pipeline micro-batch is routed, counted and given its aux loss apart, as one process does an
``--update-freq`` micro-batch, and the train line's routing numbers are summed over the stages.
"""

from __future__ import annotations

import contextlib
import logging
from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed._composable.replicate_with_fsdp import replicate
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor, distribute_tensor
from torch.nn.parallel import DistributedDataParallel

from distlm.choices import PP_LOOPED_SCHEDULES
from distlm.data.masking import IGNORE_INDEX
from distlm.errors import UsageError
from distlm.layout import Layout, PipelineLayout
from distlm.mesh import ParallelDims
from distlm.models.contract import allocate_meta_buffers, model_blocks
from distlm.models.loss import summed_token_loss
from distlm.models.moe.model import moe_layers
from distlm.parallel.ddp import apply_ddp
from distlm.parallel.expert import apply_moe, expert_parameters, routing_over_stages
from distlm.parallel.fsdp import fsdp_dtypes
from distlm.parallel.handle import DataParallelHandle
from distlm.parallel.tp import _pattern_regex, clip_grad_norm_, local_value, shard_gradients_like_parameters
from distlm.precision import MODE_DTYPES
from distlm.state.names import local_shard, single_device_name

logger = logging.getLogger("distlm")

SCHEDULES = {
    "gpipe": "ScheduleGPipe",
    "1f1b": "Schedule1F1B",
    "interleaved-1f1b": "ScheduleInterleaved1F1B",
    "zero-bubble": "ScheduleInterleavedZeroBubble",
    "zbv": "ScheduleZBVZeroBubble",
}
"""Each --pp-schedule's class in torch.distributed.pipelining, by name. That package imports
torch._dynamo, half a second of every process's start-up, so it is imported only when a
pipeline is built (``PipelineRunner._schedule``)."""
PARTS = ("embed", "block_args", "head", "embed_modules", "head_modules")
"""What a model declares so that its forward can be cut into stages (models/contract.py)."""


# --------------------------------------------------------------------- checks

def check_pipeline(model: nn.Module, config: Any, dims: ParallelDims, name: str) -> None:
    """UsageError for a pipeline layout that cannot run (``model`` may be on meta)."""
    layout = Layout.from_config(config.distributed)
    pipeline, degree = layout.pipeline, dims.pp
    blocks = model_blocks(model)
    if blocks is None or len(blocks) == 0:
        raise UsageError(f"--pp-degree cuts the model along its blocks, and {name} declares none "
                         "(an nn.ModuleList `blocks`); drop --pp-degree or declare them")
    missing = [part for part in PARTS if not hasattr(model, part)]
    if missing:
        raise UsageError(f"--pp-degree runs {name}'s forward in parts, and it lacks {', '.join(missing)} "
                         "(see distlm/models/contract.py); drop --pp-degree or add them")
    stages = pipeline.stage_count(degree)
    if stages > len(blocks):
        raise UsageError(f"--pp-degree {degree} x --pp-stages-per-rank {pipeline.stages_per_rank} = {stages} stages, "
                         f"but {name} has {len(blocks)} block{'s' if len(blocks) != 1 else ''}; use at most "
                         f"{len(blocks)} stage{'s' if len(blocks) != 1 else ''}")
    pipeline.check_stages_per_rank()
    pipeline.check_microbatches(degree, config.data.batch_size)
    if pipeline.split is not None:
        parse_split(pipeline.split, stages, len(blocks))
    if layout.hooks_asked:
        raise UsageError("--comm-hook/--double-buffering/--comm-transport do not compose with --pp-degree "
                         "(the pipeline drives DDP's reducer itself); drop them")
    if config.compile.compile and pipeline.splits_backward:
        raise UsageError(f"--pp-schedule {pipeline.schedule} splits backward into input and weight parts, which "
                         "torch cannot do for compiled blocks; drop --compile or use interleaved-1f1b")
    if layout.sequence_parallel and pipeline.stages_per_rank > 1 and \
            "sequence_region" in getattr(model, "tp_plan", {}).values():
        raise UsageError(f"--sequence-parallel shards {name}'s blocks as one sequence region, which a rank's "
                         "several stages would split; use --pp-stages-per-rank 1 or drop --sequence-parallel")
    tied = set(model.embed_modules) & set(model.head_modules)
    if pipeline.schedule == "zbv" and tied and dims.dp_enabled:
        raise UsageError(f"--pp-schedule zbv puts the first and the last stage on one rank, where {name}'s tied "
                         f"{', '.join(sorted(tied))} would be wrapped twice for data parallel; use interleaved-1f1b")


def parse_split(text: str, stages: int, blocks: int) -> list[range]:
    """``0:12,12:24`` as block ranges; UsageError unless they cover 0..blocks in order, one per stage."""
    try:
        ranges = [range(int(a), int(b)) for a, b in (part.split(":") for part in text.split(","))]
    except ValueError:
        raise UsageError(f"--pp-split {text!r} is not a list of START:END block ranges such as 0:12,12:24") from None
    if len(ranges) != stages:
        raise UsageError(f"--pp-split {text!r} gives {len(ranges)} stages, but the layout has {stages}; "
                         "give one START:END per stage")
    position = 0
    for stage in ranges:
        if stage.start != position or len(stage) < 1:
            raise UsageError(f"--pp-split {text!r}: the ranges must be non-empty and follow each other from 0")
        position = stage.stop
    if position != blocks:
        raise UsageError(f"--pp-split {text!r} ends at block {position}, "
                         f"but the model has {blocks} block{'s' if blocks != 1 else ''}")
    return ranges


def balanced_split(model: nn.Module, stages: int) -> list[range]:
    """Contiguous block ranges, one per stage, minimising the largest stage's parameter count
    (the embedding counts on the first stage, the head on the last)."""
    sizes = [sum(p.numel() for p in block.parameters()) for block in model_blocks(model)]
    first = _part_size(model, model.embed_modules)
    last = _part_size(model, model.head_modules)
    n = len(sizes)
    prefix = [0]
    for size in sizes:
        prefix.append(prefix[-1] + size)

    def cost(stage: int, start: int, stop: int) -> int:
        return prefix[stop] - prefix[start] + (first if stage == 0 else 0) + (last if stage == stages - 1 else 0)

    # best[s][i]: the smallest largest-stage cost of the first i blocks in s stages.
    inf = float("inf")
    best = [[inf] * (n + 1) for _ in range(stages + 1)]
    cut = [[0] * (n + 1) for _ in range(stages + 1)]
    best[0][0] = 0
    for s in range(1, stages + 1):
        for i in range(s, n - (stages - s) + 1):
            for j in range(s - 1, i):
                value = max(best[s - 1][j], cost(s - 1, j, i))
                if value < best[s][i]:
                    best[s][i], cut[s][i] = value, j
    bounds, i = [], n
    for s in range(stages, 0, -1):
        bounds.append(range(cut[s][i], i))
        i = cut[s][i]
    return bounds[::-1]


def _part_size(model: nn.Module, names: tuple[str, ...]) -> int:
    params = {id(p): p for name in names if getattr(model, name, None) is not None
              for p in getattr(model, name).parameters()}
    return sum(p.numel() for p in params.values())


def stages_of_rank(pp_rank: int, degree: int, per_rank: int, schedule: str) -> list[int]:
    """The stage indices a rank runs: looped (r, r + P, ...) or, for zbv, the V shape (r, 2P - 1 - r)."""
    if schedule == "zbv":
        return [pp_rank, 2 * degree - 1 - pp_rank]
    return [pp_rank + k * degree for k in range(per_rank)]


# ----------------------------------------------------------------- the stages

class StageBlocks(nn.ModuleList):
    """A stage's blocks under their single-device indices (``layers.5`` stays ``layers.5``),
    indexed by position as a ModuleList is."""

    def __init__(self, blocks: dict[int, nn.Module]) -> None:
        super().__init__()
        for index, block in blocks.items():
            self.add_module(str(index), block)

    def _key(self, idx: int) -> str:
        return list(self._modules)[idx]

    def __getitem__(self, idx):
        if isinstance(idx, slice):
            return list(self._modules.values())[idx]
        return self._modules[self._key(idx)]

    def __setitem__(self, idx: int, module: nn.Module) -> None:
        setattr(self, self._key(idx), module)


class StageChunk(nn.Module):
    """One stage: the embedding (first stage), some blocks, the head (last stage).

    It registers only its own parts, so DDP or FSDP wrapped around it hold exactly this
    stage's parameters; the model itself (whose ``embed``, ``block_args`` and ``head`` it
    calls) is kept unregistered.
    """

    def __init__(self, model: nn.Module, block_indices: range, first: bool, last: bool, parts: tuple[str, ...]):
        super().__init__()
        object.__setattr__(self, "_model", model)
        self.first, self.last = first, last
        self.parts = nn.ModuleDict({name: getattr(model, name) for name in parts})
        blocks = model_blocks(model)
        by_index = dict(zip((int(key) for key in blocks._modules), blocks))
        self.blocks = nn.ModuleList(by_index[index] for index in block_indices)

    def forward(self, x: torch.Tensor, *ids: torch.Tensor):
        """The first stage takes ``input_ids`` (and with document masking ``document_ids``), a
        later one the residual stream followed by them; all but the last hand the ids on."""
        model = self._model
        if self.first:
            ids, x = (x, *ids), model.embed(x)
        block_args = model.block_args(*ids)
        for block in self.blocks:
            x = block(x, *block_args)
        return model.head(x) if self.last else (x, *ids)


def cut_model(model: nn.Module, keep: list[range], first: bool, last: bool) -> nn.Module:
    """``model`` in place, left with the blocks of ``keep`` and the embedding and head its stages need."""
    blocks = model_blocks(model)
    attribute = next(name for name, child in model.named_children() if child is blocks)
    kept = {index: blocks[index] for stage in keep for index in stage}
    setattr(model, attribute, StageBlocks(dict(sorted(kept.items()))))
    needed = set(model.embed_modules if first else ()) | set(model.head_modules if last else ())
    for name in set(model.embed_modules) | set(model.head_modules):
        if name not in needed:
            setattr(model, name, None)
    plan = getattr(model, "tp_plan", None)
    if plan:
        # A stage keeps the tensor-parallel plan entries of the modules it holds.
        names = [name for name, _ in model.named_modules() if name]
        model.tp_plan = {pattern: style for pattern, style in plan.items()
                         if any(_pattern_regex(pattern).match(name) for name in names)}
    return model


# ----------------------------------------------------------------- the runner

class PipelineRunner:
    """Runs a rank's stages through one schedule for training and another, forward only,
    for validation; owns the tied-embedding group and the pipeline's loss reduction."""

    def __init__(self, model: nn.Module, chunks: list[nn.Module], stage_ids: list[int], dims: ParallelDims,
                 device: torch.device, pipeline: PipelineLayout, tied: list[nn.Parameter],
                 tied_group: dist.ProcessGroup | None):
        self.model, self.dims, self.device = model, dims, device
        self.pipeline = pipeline
        self.group = dims.pp_group(device.type)
        self.stage_count = pipeline.stage_count(dims.pp)
        self.microbatches = pipeline.microbatch_count(dims.pp)
        self.holds_first = 0 in stage_ids
        self.holds_last = self.stage_count - 1 in stage_ids
        self.tied, self.tied_group = tied, tied_group
        self.padding_idx = model.padding_idx
        self.ddp_chunks = [chunk for chunk in chunks if isinstance(chunk, DistributedDataParallel)]
        self._factor: torch.Tensor | float = 1.0
        self._losses: list[torch.Tensor] = []
        self.train_schedule = self._schedule(chunks, stage_ids, pipeline.schedule, self._scaled_loss)
        # Validation batches have their own shape: stages of their own, forward only.
        eval_name = pipeline.schedule if pipeline.looped else "gpipe"
        self.eval_schedule = self._schedule(chunks, stage_ids, eval_name, self._scaled_loss)
        if eval_name == "zbv":
            # torch 2.13's zbv still hands gradients between a rank's two stages when run
            # forward only (eval() fails); its own order without the backward actions does not.
            from torch.distributed.pipelining.schedules import _ComputationType as kind  # see SCHEDULES

            forward = {kind.FORWARD, kind.SEND_F, kind.RECV_F, kind.UNSHARD, kind.RESHARD}
            orders = self.eval_schedule.pipeline_order_with_comms
            for rank, actions in orders.items():
                orders[rank] = [action for action in actions if action.computation_type in forward]

    def _schedule(self, chunks, stage_ids, name: str, loss_fn: Callable):
        import torch.distributed.pipelining as pipelining  # see SCHEDULES

        stages = [pipelining.PipelineStage(chunk, index, self.stage_count, self.device, group=self.group)
                  for chunk, index in zip(chunks, stage_ids)]
        cls = getattr(pipelining, SCHEDULES[name])
        if name in PP_LOOPED_SCHEDULES:
            return cls(stages, n_microbatches=self.microbatches, loss_fn=loss_fn, scale_grads=False)
        return cls(stages[0], n_microbatches=self.microbatches, loss_fn=loss_fn, scale_grads=False)

    def _scaled_loss(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        loss = summed_token_loss(logits, targets)
        self._losses.append(local_value(loss.detach()).double())
        return loss * self._factor

    def _run(self, schedule, batch: dict[str, torch.Tensor], forward_only: bool) -> None:
        ids = (batch["input_ids"], batch["document_ids"]) if "document_ids" in batch else (batch["input_ids"],)
        args = ids if self.holds_first else ()
        target = batch["targets"] if self.holds_last else None
        before = len(self._losses)
        routed = {layer: len(layer.routed) for layer in moe_layers(self.model)}
        with contextlib.ExitStack() as unsynced:
            # The schedule arms DDP's reducer itself, before the last micro-batch's backward.
            # Its first pass also infers shapes by calling the DDP module outside no_sync, which
            # arms the reducer for a backward that never reaches the parameters: the first
            # micro-batch's backward was then reduced as well, and with no forward between it
            # and the last one (micro-batches = stages) DDP recorded every parameter twice for
            # its bucket rebuild and failed the next forward. Nothing else may arm it.
            for chunk in self.ddp_chunks:
                unsynced.enter_context(chunk.no_sync())
            if forward_only:
                schedule.eval(*args, target=target)
            else:
                schedule.step(*args, target=target, return_outputs=False)
        # A schedule's first pass infers the stages' shapes by running the last stage once
        # more on uninitialised inputs, loss included: a pass's own losses are its last M.
        del self._losses[before:len(self._losses) - self.microbatches]
        if not forward_only:
            for layer, count in routed.items():  # so are a mixture of experts' routing statistics
                del layer.routed[count:len(layer.routed) - self.microbatches]

    def _loss_sum(self) -> torch.Tensor:
        """The summed loss of the last stage's micro-batches, on every rank of the pipeline (collective)."""
        total = torch.zeros((), dtype=torch.float64, device=self.device)
        for loss in self._losses:
            total += loss
        self._losses = []
        dist.all_reduce(total, group=self.group)
        return total

    def forward_backward(self, batches: list[dict[str, torch.Tensor]], factor: torch.Tensor,
                         autocast: Callable) -> torch.Tensor:
        """Forward and backward of whole pipeline passes, one per ``--update-freq`` batch, each
        micro-batch's loss multiplied by ``factor``; returns the summed (unscaled) loss."""
        self._factor = factor.reshape(())  # a scalar: it may meet a tensor-parallel (DTensor) loss
        for batch in batches:
            with autocast():
                self._run(self.train_schedule, batch, forward_only=False)
        self.sum_tied_gradients()
        return self._loss_sum()

    def routing(self, routing: dict[str, Any]) -> dict[str, Any]:
        """An update's routing statistics of this rank's MoE layers (``finish_update``) made the
        whole model's on every rank of the pipeline (collective over pp where the model has MoE layers)."""
        if not getattr(self.model.config, "n_moe_layers", 0):
            return routing
        return routing_over_stages(routing, self.group, self.device)

    @torch.no_grad()
    def eval_loss(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        """The summed loss of ``batch`` run forward through the pipeline (collective over pp)."""
        rows = batch["input_ids"].shape[0]
        extra = -rows % self.microbatches
        if extra:  # rows of padding with nothing to predict, so the micro-batches split evenly
            batch = dict(batch)
            batch["input_ids"] = torch.cat([batch["input_ids"], batch["input_ids"].new_full(
                (extra, batch["input_ids"].shape[1]), self.padding_idx)])
            batch["targets"] = torch.cat([batch["targets"], batch["targets"].new_full(
                (extra, batch["targets"].shape[1]), IGNORE_INDEX)])
            if "document_ids" in batch:  # padding is a document of its own
                batch["document_ids"] = torch.cat([batch["document_ids"], batch["document_ids"].new_full(
                    (extra, batch["document_ids"].shape[1]), -1)])
        self._factor = 1.0
        self._run(self.eval_schedule, batch, forward_only=True)
        return self._loss_sum()

    @torch.no_grad()
    def sum_tied_gradients(self) -> None:
        """The first and the last stage's copies of a tied weight receive the sum of both gradients."""
        if self.tied_group is None:
            return
        for param in self.tied:
            grad = param.grad
            dist.all_reduce(local_shard(grad), group=self.tied_group)

    @property
    def uncounted(self) -> list[nn.Parameter]:
        """The last stage's copies of tied weights, which the gradient norm leaves to the first stage's."""
        return list(self.tied) if self.tied_group is not None and self.holds_last else []


@dataclass
class PipelineHandle(DataParallelHandle):
    """The data-parallel handle of one pipeline stage: clipping and the finite check see the
    gradient norm of the whole model, reduced over the pipeline."""

    runner: PipelineRunner | None = None

    def gradient_sync(self, enabled: bool):
        return contextlib.nullcontext()  # the schedule drives DDP's and FSDP's reduction itself

    def clip_grad_norm_(self, max_norm: float) -> torch.Tensor:
        with self.mixed_placements():
            return clip_grad_norm_(self.model.parameters(), max_norm, self.foreach_clip, group=self.runner.group,
                                   uncounted=self.runner.uncounted)


# ------------------------------------------------------------- parallelising

@dataclass
class StageLayout:
    """Which stages this rank runs and what their chunks hold, fixed when the model is cut."""

    model: nn.Module
    """The single-device model left with this rank's blocks, embedding and head."""
    ranges: list[range]
    """Every stage's blocks."""
    stage_ids: list[int]
    """This rank's stages."""
    embed_modules: tuple[str, ...]
    head_modules: tuple[str, ...]
    on_meta: bool

    @property
    def stage_count(self) -> int:
        return len(self.ranges)


def cut_stages(model: nn.Module, dims: ParallelDims, pipeline: PipelineLayout) -> StageLayout:
    """``model`` cut down to this rank's stages, before tensor parallel and the rest apply."""
    stage_count = pipeline.stage_count(dims.pp)
    blocks = len(model_blocks(model))
    ranges = (parse_split(pipeline.split, stage_count, blocks) if pipeline.split
              else balanced_split(model, stage_count))
    stage_ids = stages_of_rank(dims.pp_rank(dist.get_rank()), dims.pp, pipeline.stages_per_rank, pipeline.schedule)
    layout = StageLayout(model, ranges, stage_ids, tuple(model.embed_modules), tuple(model.head_modules),
                         on_meta=any(p.is_meta for p in model.parameters()))
    cut_model(model, [ranges[s] for s in stage_ids], 0 in stage_ids, stage_count - 1 in stage_ids)
    return layout


def parallelize_stages(layout: StageLayout, dims: ParallelDims, device: torch.device, options: Any,
                       whole_model: Callable[..., nn.Module] | None,
                       fill_shards: Callable[[nn.Module], None] | None) -> tuple[nn.Module, PipelineHandle]:
    """FSDP or DDP around each of this rank's stage chunks (their layers already transformed),
    the weights, and the schedules (``options``: ``parallel.api.ParallelOptions``, its layout's
    pipeline); the pruned model and its handle."""
    pipeline = options.layout.pipeline
    model, ranges, stage_ids, last_stage = layout.model, layout.ranges, layout.stage_ids, layout.stage_count - 1
    mesh = dims.build_mesh(device.type)
    chunks = [StageChunk(model, ranges[s], s == 0, s == last_stage,
                         (layout.embed_modules if s == 0 else ()) + (layout.head_modules if s == last_stage else ()))
              for s in stage_ids]
    dtypes = MODE_DTYPES[options.precision]
    # A mixture of experts' layers in this stage: statistics over the stage's data-parallel ranks,
    # experts split over its expert-parallel groups and left out of the dense wrapping.
    expert_gradients = apply_moe(model, dims, device, dtypes.autocast or dtypes.param, options.grouped_mm,
                                 compiled=options.compile_backend is not None)
    experts = expert_parameters(model) or None
    fsdp = dims.strategy == "fsdp" and dims.dp_enabled
    param_dtype = reduce_dtype = None
    if fsdp:
        param_dtype, reduce_dtype = fsdp_dtypes(options.precision)
        chunks = [_shard_chunk(chunk, mesh["dp"], param_dtype, reduce_dtype, experts) for chunk in chunks]
    elif dims.dp_enabled and (dims.tp_enabled or experts):
        # torch DDP fails beside the experts' DTensors (distlm/parallel/api.py): replicate, as under TP.
        for chunk in chunks:
            for block in chunk.blocks:
                replicate(block, mesh=mesh["dp"], ignored_params=experts)
            replicate(chunk, mesh=mesh["dp"], ignored_params=experts)
    if layout.on_meta:
        _materialise_stage(model, chunks, device, whole_model, fill_shards)
        if dims.tp_enabled:
            shard_gradients_like_parameters(model)
    if dims.dp_enabled and not fsdp and not dims.tp_enabled and not experts:
        chunks = [apply_ddp(chunk, device, dims.dp_group(device.type), options.layout.bucket_cap_mb)
                  for chunk in chunks]
    tied_names = sorted(set(layout.embed_modules) & set(layout.head_modules))
    tied = [p for name in tied_names if getattr(model, name, None) is not None
            for p in getattr(model, name).parameters()]
    tied_group = _tied_group(dims, mesh, pipeline.schedule) if tied_names else None
    runner = PipelineRunner(model, chunks, stage_ids, dims, device, pipeline, tied, tied_group)
    logger.info("applied pipeline parallel: %d stages over %d ranks (%s, %d micro-batches), blocks %s",
                layout.stage_count, dims.pp, pipeline.schedule, runner.microbatches,
                ",".join(f"{r.start}:{r.stop}" for r in ranges))
    handle = PipelineHandle(
        model=model, dims=dims, dp_group=dims.dp_group(device.type),
        shards_optimizer_state=dims.strategy == "zero1" and dims.dp_enabled,
        mixed_precision_by_strategy=fsdp and param_dtype is not None,
        sync_bucket_mb=options.layout.bucket_cap_mb, foreach_clip=options.foreach_clip, runner=runner,
        expert_gradients=expert_gradients,
    )
    return model, handle


def _shard_chunk(chunk: StageChunk, dp_mesh, param_dtype, reduce_dtype, ignored_params=None) -> nn.Module:
    """FSDP2 per block, then the stage's own embedding and head as its root unit;
    ``ignored_params`` (expert parallel's experts) are left alone."""
    policy = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype)
    for block in chunk.blocks:
        fully_shard(block, mesh=dp_mesh, mp_policy=policy, ignored_params=ignored_params)
    return fully_shard(chunk, mesh=dp_mesh, mp_policy=policy, ignored_params=ignored_params)


@torch.no_grad()
def _materialise_stage(model: nn.Module, chunks: list[nn.Module], device: torch.device,
                       whole_model: Callable[..., nn.Module] | None,
                       fill_shards: Callable[[nn.Module], None] | None) -> None:
    """Allocate the stage's shards and fill them: from ``whole_model(keep=...)``, which
    every rank draws for itself holding only its stage's parameters (the same seed gives
    the same weights, and no rank waits for another's stage), or in place by
    ``fill_shards``. Through each chunk, so FSDP's bookkeeping follows the new storage."""
    for chunk in chunks:
        chunk.to_empty(device=device)
    allocate_meta_buffers(model, device)
    if fill_shards is not None:
        fill_shards(model)
        return
    if whole_model is None:
        return
    whole = whole_model(keep={single_device_name(name) for name, _ in model.named_parameters()})
    source = {**dict(whole.named_parameters()), **dict(whole.named_buffers())}
    for name, tensor in [*model.named_parameters(), *model.named_buffers()]:
        value = source[single_device_name(name)].to(device)
        if isinstance(tensor, DTensor):
            value = distribute_tensor(value, tensor.device_mesh, tensor.placements, src_data_rank=None).to_local()
            tensor = tensor.to_local()
        tensor.copy_(value)
    logger.info("materialised each pipeline stage's own weights from the seed")


def _tied_group(dims: ParallelDims, mesh, schedule: str) -> dist.ProcessGroup | None:
    """The two ranks (same dp and tp coordinates) holding the first and the last stage; None
    where one rank holds both (zbv), whose stages then share the one parameter."""
    if schedule == "zbv":
        return None
    grid = mesh.mesh  # ranks, shaped (pp, dp, tp)
    mine = None
    for d in range(dims.dp):
        for t in range(dims.tp):
            ranks = [int(grid[0, d, t]), int(grid[dims.pp - 1, d, t])]
            group = dist.new_group(ranks)
            if dist.get_rank() in ranks:
                mine = group
    return mine
