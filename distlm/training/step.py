"""One update of a run: ``--update-freq`` micro-batches, gradients synchronised on the last
only; the summed loss divided once by the global number of target tokens; unscale, clip,
finite check, step, learning rate.

``Update`` holds, by name, the parts of the run the update reads and moves (model, handle,
optimizer, progress, ...); the Trainer builds it once and calls it as ``Trainer.train_step``,
which tests and subclasses replace. The loop around it (log, validate, save) is
distlm/training/trainer.py.
"""

from __future__ import annotations

import contextlib
import logging
import math
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
import torch.distributed as dist
from torch import nn

from distlm.checkpoint import TrainProgress
from distlm.data.batches import to_device
from distlm.models.moe.model import finish_update, set_aux_loss_weight
from distlm.observe.observer import Observer
from distlm.observe.printer import significant
from distlm.optim import LRSchedule
from distlm.parallel.handle import DataParallelHandle
from distlm.parallel.pipeline import PipelineRunner
from distlm.parallel.replicas import check_replicas
from distlm.parallel.tp import local_value
from distlm.precision import Precision
from distlm.runtime.context import DistContext
from distlm.runtime.signals import StopSignals
from distlm.training.divergence import DivergenceError, first_nonfinite_gradient, locate_nonfinite
from distlm.training.memory import memory_report

logger = logging.getLogger("distlm")


@dataclass(frozen=True)
class UpdateSettings:
    """The command line's settings an update reads."""

    clip_norm: float
    """--clip-norm; 0: no clipping."""
    log_interval: int
    """Memory is measured on the updates that are logged (--log-interval) and the last."""
    check_replicas: bool
    """--check-replicas: every copy of a parameter compared after every update."""


@dataclass
class Update:
    """One update over this rank's micro-batches, and the parts of the run it works on."""

    ctx: DistContext
    model: nn.Module
    handle: DataParallelHandle
    optimizer: torch.optim.Optimizer
    precision: Precision
    schedule: LRSchedule
    progress: TrainProgress
    sampler: Any
    """The run's ``GlobalBatchSampler``: how many samples an update consumes."""
    stop: StopSignals
    observer: Observer
    settings: UpdateSettings
    compute_loss: Callable[[dict[str, torch.Tensor]], torch.Tensor]
    """Summed cross-entropy over a batch's targets."""
    autocast: Callable[[], contextlib.AbstractContextManager]
    """Mixed precision for forward (none where the strategy casts itself)."""
    finished: Callable[[], bool]
    """Whether the run is over (--max-update, --max-epoch), asked after the update counts."""
    pipeline: PipelineRunner | None = None
    """pp > 1: the schedules run the micro-batches (distlm/parallel/pipeline.py)."""
    last_memory: dict[str, int] = field(default_factory=dict)
    """Bytes this rank held at the last logged update (parameters, gradients, optimizer state)."""

    def __call__(self, micro_batches: list[dict[str, Any]]) -> dict[str, Any]:
        """The update; the record the loop logs: loss and token sums, lr, gnorm, whether it applied."""
        ctx, handle, precision, progress = self.ctx, self.handle, self.precision, self.progress
        device = ctx.device
        local_targets = sum(b["target_count"] for b in micro_batches)
        tensors = [to_device(b, device) for b in micro_batches]
        # One all-reduce over every rank carries the target count and the stop signals, so
        # every rank learns at this update that some rank was signalled, under tensor and
        # pipeline parallelism too, for no collective of their own. The ranks of one replica
        # hold the same batch: the world's sum counts each replica's targets world / dp times
        # (integers, exact in float64).
        counts = torch.tensor([local_targets, *self.stop.local_flags()], dtype=torch.float64, device=device)
        if ctx.world_group is not None:
            with self.observer.waiting_for_peers():  # ranks with their batch ready wait here for the late ones
                dist.all_reduce(counts, group=ctx.world_group)
        # A 0-dim tensor: a one-element vector would make each loss it scales a non-scalar to backward.
        global_targets = counts[0] / (ctx.world_size // ctx.dims.dp)
        loss_scale = precision.loss_scale
        # DDP averages gradients over replicas; multiplying by their number makes the
        # result the gradient of (summed loss / global target tokens): normalised once.
        # A device tensor, so nothing waits for the count to reach the host.
        factor = (ctx.dims.dp * loss_scale / global_targets.clamp(min=1)).float()
        gradient_loss_scale = handle.gradient_loss_scale(loss_scale)
        # A mixture of experts' auxiliary loss takes the weight the mean cross-entropy gets,
        # averaged over the micro-batches (distlm/models/moe/model.py); a dense model has none.
        # A pipeline splits each into micro-batches of its own, each routed (and its aux loss taken) apart.
        forwards = len(tensors) * (self.pipeline.microbatches if self.pipeline is not None else 1)
        set_aux_loss_weight(self.model, float(ctx.dims.dp * loss_scale / forwards))

        self.model.train()
        loss_sum = torch.zeros((), dtype=torch.float64, device=device)
        if self.pipeline is not None:  # whole pipeline passes; the loss arrives from the last stage
            with handle.loss_context():
                loss_sum = self.pipeline.forward_backward(tensors, factor, self.autocast)
        else:
            for i, batch in enumerate(tensors):
                with handle.gradient_sync(enabled=i == len(tensors) - 1), handle.loss_context():
                    with self.autocast():
                        loss = self.compute_loss(batch)
                    (loss * factor).backward()
                loss_sum += handle.local_loss(loss.detach()).double()

        update = progress.num_updates + 1
        lr = self.schedule.apply(self.optimizer, update)
        gnorm = handle.unscale_and_clip_(gradient_loss_scale, self.settings.clip_norm or math.inf)
        # The update's one host synchronisation: the gradient norm, and whether any rank was signalled.
        gnorm_value, *signalled = torch.cat([local_value(gnorm).detach().reshape(1).double(), counts[1:]]).tolist()
        self.stop.agree(signalled)
        finite = math.isfinite(gnorm_value)
        applied = finite and handle.gradients_ready
        if not finite and precision.scaler is None:
            name = first_nonfinite_gradient(self.model, ctx.world_group)
            raise DivergenceError(
                f"update {update}: the gradient norm is {gnorm_value}, first non-finite in the gradient of {name}; "
                "the run diverged: lower --lr (or clip with --clip-norm)"
            )
        if not finite:
            logger.info("update %d: gradient overflow at loss scale %g, update skipped", update, loss_scale)
        elif not applied:
            logger.info("double buffering: the first update's gradients are still in flight; it applies no update")
        else:
            with handle.mixed_placements():
                ctx.backend.optimizer_step(self.optimizer)
            progress.num_updates = update
        if precision.scaler is not None:
            try:
                precision.scaler.update(not finite)
            except FloatingPointError as err:
                self.optimizer.zero_grad(set_to_none=True)
                with self.autocast(), handle.loss_context():
                    place = locate_nonfinite(self.model, tensors, self.compute_loss, factor, ctx.all_gather_object)
                raise DivergenceError(f"update {update}: {err}; first non-finite: {place}") from None
        routing = finish_update(self.model, applied)  # a mixture of experts' statistics, its bias step
        if self.pipeline is not None:
            routing = self.pipeline.routing(routing)  # every stage's MoE layers
        # Before finished(), which --max-epoch reads.
        progress.consumed_samples += self.sampler.samples_in_update(progress.consumed_samples)
        if self.finished() or progress.num_updates % self.settings.log_interval == 0:
            # Measured while gradients still exist: zero_grad below frees them.
            self.last_memory = memory_report(self.model, self.optimizer)
        self.optimizer.zero_grad(set_to_none=True)
        ctx.backend.mark_step()
        if self.settings.check_replicas:
            check_replicas(self.model, ctx, progress.num_updates)
        record = {
            "loss_sum": loss_sum, "target_tokens": local_targets,
            "input_tokens": sum(b["input_count"] for b in micro_batches),
            "samples": sum(len(b["input_ids"]) for b in micro_batches),
            "batch_tokens": sum(b["input_ids"].numel() for b in micro_batches),
            "lr": significant(lr), "gnorm": gnorm_value, "applied": applied,
            **{name: significant(value) if isinstance(value, float) else value for name, value in routing.items()},
        }
        if any("attention_pairs" in b for b in micro_batches):  # packed documents: MFU counts their attention
            record["attention_pairs"] = sum(b.get("attention_pairs", 0) for b in micro_batches)
        if precision.scaler is not None:
            record["loss_scale"] = precision.loss_scale
        return record
