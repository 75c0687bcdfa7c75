"""``DataParallelHandle``: what the training loop may do with a parallelised model.

``parallelize`` returns the model and this handle. The handle owns everything that
differs between strategies and that the loop needs: gradient synchronisation on the
last micro-batch only, the loss context of a vocabulary-parallel loss, gradient clipping
for the layout, the strategy's optimizer, communication still in flight, and the loss
scale that double-buffered gradients were made with. The loop never branches on
strategy names.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Any, Iterator

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor.experimental import implicit_replication
from torch.nn.parallel import DistributedDataParallel

from distlm.layout import Layout
from distlm.mesh import ParallelDims
from distlm.optim import AdamWSettings, build_optimizer
from distlm.parallel.ddp import DoubleBufferState
from distlm.parallel.tp import clip_grad_norm_ as tp_clip_grad_norm_
from distlm.parallel.tp import local_value, loss_context


@contextlib.contextmanager
def gradient_sync(model: nn.Module, enabled: bool) -> Iterator[None]:
    """Synchronise gradients in this backward or not, whatever wraps ``model``."""
    if hasattr(model, "set_requires_gradient_sync"):  # FSDP2 and replicate
        model.set_requires_gradient_sync(enabled)
        yield
    elif not enabled and isinstance(model, DistributedDataParallel):
        with model.no_sync():
            yield
    else:
        yield


@dataclass
class DataParallelHandle:
    model: nn.Module
    dims: ParallelDims
    dp_group: dist.ProcessGroup | None
    shards_optimizer_state: bool = False
    """ZeRO-1: Adam's state sharded over the data-parallel group."""
    double_buffer: DoubleBufferState | None = None
    """ChainerMN double buffering: gradients arrive one update late."""
    mixed_precision_by_strategy: bool = False
    """FSDP's MixedPrecisionPolicy casts parameters itself, so no autocast is layered on top."""
    sync_bucket_mb: float = Layout.bucket_cap_mb
    foreach_clip: bool | None = True
    """foreach value of the clipping kernels: None where the device has no foreach kernels (XLA)."""
    expert_gradients: Any = None
    """Expert parallel: reduces the experts' gradients over the ranks holding the same experts
    (``distlm.parallel.expert.ExpertGradients``), which the dense strategy leaves out."""
    _inflight_loss_scale: float = field(default=1.0, init=False)

    # ------------------------------------------------------------------ backward

    def gradient_sync(self, enabled: bool):
        """Synchronise gradients in this backward or not (DDP's no_sync, FSDP2's requires_gradient_sync)."""
        return gradient_sync(self.model, enabled)

    def loss_context(self):
        """Compute the loss and call backward inside this (tensor parallel's loss_parallel)."""
        return loss_context(self.model)

    @staticmethod
    def local_loss(loss: torch.Tensor) -> torch.Tensor:
        """A plain tensor of a (replicated DTensor) loss."""
        return local_value(loss)

    # -------------------------------------------------------------------- update

    def gradient_loss_scale(self, loss_scale: float) -> float:
        """The loss scale of the gradients this update applies; ``loss_scale`` is this backward's.

        With double buffering the gradients that come back were made one update ago,
        with the scale of that update; call once per update.
        """
        if self.double_buffer is None:
            return loss_scale
        made_with, self._inflight_loss_scale = self._inflight_loss_scale, loss_scale
        return made_with

    @property
    def gradients_ready(self) -> bool:
        """False on the first update of double buffering, whose gradients are still in flight."""
        return self.double_buffer is None or not self.double_buffer.first_step

    def unscale_and_clip_(self, loss_scale: float, max_norm: float) -> torch.Tensor:
        """Divide the gradients by the loss scale they were made with, then clip them to
        ``max_norm``; returns the global gradient norm (a device tensor)."""
        if self.expert_gradients is not None:
            self.expert_gradients.reduce()
        if loss_scale != 1.0:
            grads = [p.grad for p in self.model.parameters() if p.grad is not None]
            with self.mixed_placements():
                torch._foreach_mul_(grads, 1.0 / loss_scale)
        return self.clip_grad_norm_(max_norm)

    def clip_grad_norm_(self, max_norm: float) -> torch.Tensor:
        """Global gradient norm over every layout, clipped to ``max_norm`` (inf: no clipping)."""
        params = [p for p in self.model.parameters() if p.grad is not None]
        with self.mixed_placements():
            if self.dims.tp_enabled or self.dims.ep_enabled:
                # Groups gradients by device mesh (embeddings on dp, layers on dp x tp),
                # which torch's own refuses to mix.
                return tp_clip_grad_norm_(params, max_norm, foreach=self.foreach_clip)
            return torch.nn.utils.clip_grad_norm_(params, max_norm, foreach=self.foreach_clip)

    def mixed_placements(self):
        """Tensor parallel without a data-parallel wrapper leaves parameters outside the plan
        (norms) as plain tensors beside DTensors; torch's foreach kernels refuse such mixed
        lists unless the plain ones are taken as replicated, which they are."""
        return implicit_replication() if self.dims.tp_enabled or self.dims.ep_enabled else contextlib.nullcontext()

    def build_optimizer(self, settings: AdamWSettings, param_dtype: torch.dtype) -> torch.optim.Optimizer:
        """AdamW over the model's parameters; ZeRO-1 shards its state over the data-parallel group."""
        if self.shards_optimizer_state:
            # Imported here: torch.distributed.optim, on which ZeRO-1 builds, scripts a dozen
            # functional optimizers as it loads, a start-up cost that only this strategy needs.
            from distlm.parallel.zero1 import build_zero1_optimizer

            return build_zero1_optimizer(
                self.model.parameters(), settings, self.dp_group, param_dtype, sync_bucket_mb=self.sync_bucket_mb
            )
        return build_optimizer(self.model.parameters(), settings, param_dtype)

    def wait_pending(self) -> None:
        """Wait for communication still in flight (double buffering), e.g. before a checkpoint."""
        if self.double_buffer is not None:
            self.double_buffer.wait_pending()
