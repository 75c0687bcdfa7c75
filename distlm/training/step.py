"""One update of the Trainer: ``--update-freq`` micro-batches, gradients synchronised on the
last only; the summed loss divided once by the global number of target tokens; unscale,
clip, finite check, step, learning rate.

It reads and moves the trainer's state (model, handle, optimizer, progress) and is called
as ``Trainer.train_step``, which tests and subclasses replace; the loop around it (log,
validate, save) stays in distlm/training/trainer.py.
"""

from __future__ import annotations

import logging
import math
from typing import Any

import torch
import torch.distributed as dist

from distlm.data.batches import to_device
from distlm.training.divergence import DivergenceError, first_nonfinite_gradient, locate_nonfinite
from distlm.training.memory import memory_report
from distlm.observe.printer import significant
from distlm.models.moe.model import finish_update, set_aux_loss_weight
from distlm.parallel.tp import local_value

logger = logging.getLogger("distlm")


def train_step(trainer, micro_batches: list[dict[str, Any]]) -> dict[str, Any]:
    """One update of ``trainer`` (a ``distlm.training.trainer.Trainer``) over this rank's micro-batches;
    the record the loop logs: loss and token sums, lr, gnorm, whether the update applied."""
    ctx, handle, precision, progress = trainer.ctx, trainer.handle, trainer.precision, trainer.progress
    device = ctx.device
    local_targets = sum(b["target_count"] for b in micro_batches)
    tensors = [to_device(b, device) for b in micro_batches]
    # One all-reduce over every rank carries the target count and the stop signals, so
    # every rank learns at this update that some rank was signalled, under tensor and
    # pipeline parallelism too, for no collective of their own. The ranks of one replica
    # hold the same batch: the world's sum counts each replica's targets world / dp times
    # (integers, exact in float64).
    counts = torch.tensor([local_targets, *trainer.stop.local_flags()], dtype=torch.float64, device=device)
    if ctx.world_group is not None:
        with trainer.observer.waiting_for_peers():  # ranks with their batch ready wait here for the late ones
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
    forwards = len(tensors) * (trainer.pipeline.microbatches if trainer.pipeline is not None else 1)
    set_aux_loss_weight(trainer.model, float(ctx.dims.dp * loss_scale / forwards))

    trainer.model.train()
    loss_sum = torch.zeros((), dtype=torch.float64, device=device)
    if trainer.pipeline is not None:  # whole pipeline passes; the loss arrives from the last stage
        with handle.loss_context():
            loss_sum = trainer.pipeline.forward_backward(tensors, factor, trainer._autocast)
    else:
        for i, batch in enumerate(tensors):
            with handle.gradient_sync(enabled=i == len(tensors) - 1), handle.loss_context():
                with trainer._autocast():
                    loss = trainer.compute_loss(batch)
                (loss * factor).backward()
            loss_sum += handle.local_loss(loss.detach()).double()

    update = progress.num_updates + 1
    lr = trainer.schedule.apply(trainer.optimizer, update)
    gnorm = handle.unscale_and_clip_(gradient_loss_scale, trainer.config.optim.clip_norm or math.inf)
    # The update's one host synchronisation: the gradient norm, and whether any rank was signalled.
    gnorm_value, *signalled = torch.cat([local_value(gnorm).detach().reshape(1).double(), counts[1:]]).tolist()
    trainer.stop.agree(signalled)
    finite = math.isfinite(gnorm_value)
    applied = finite and handle.gradients_ready
    if not finite and precision.scaler is None:
        name = first_nonfinite_gradient(trainer.model, ctx.world_group)
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
            ctx.backend.optimizer_step(trainer.optimizer)
        progress.num_updates = update
    if precision.scaler is not None:
        try:
            precision.scaler.update(not finite)
        except FloatingPointError as err:
            trainer.optimizer.zero_grad(set_to_none=True)
            with trainer._autocast(), handle.loss_context():
                place = locate_nonfinite(trainer.model, tensors, trainer.compute_loss, factor, ctx.all_gather_object)
            raise DivergenceError(f"update {update}: {err}; first non-finite: {place}") from None
    routing = finish_update(trainer.model, applied)  # a mixture of experts' statistics, its bias step
    if trainer.pipeline is not None:
        routing = trainer.pipeline.routing(routing)  # every stage's MoE layers
    progress.consumed_samples += trainer.sampler.samples_in_update(progress.consumed_samples)  # before _done(), which --max-epoch reads
    if trainer._done() or progress.num_updates % trainer.config.logging.log_interval == 0:
        # Measured while gradients still exist: zero_grad below frees them.
        trainer.last_memory = memory_report(trainer.model, trainer.optimizer)
    trainer.optimizer.zero_grad(set_to_none=True)
    ctx.backend.mark_step()
    if trainer.config.distributed.check_replicas:
        trainer.check_replicas()
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

