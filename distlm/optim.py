"""The optimizer (AdamW) and the learning-rate schedules (polynomial decay, cosine, fixed)."""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from typing import Any, Iterable

import torch

from distlm.config import OptimConfig

logger = logging.getLogger("distlm")


@dataclass(frozen=True)
class AdamWSettings:
    """AdamW's hyperparameters, as plain values for the strategies that build optimizers."""

    lr: float
    betas: tuple[float, float]
    eps: float
    weight_decay: float

    @classmethod
    def from_config(cls, cfg: OptimConfig) -> "AdamWSettings":
        return cls(lr=cfg.lr, betas=tuple(cfg.adam_betas), eps=cfg.adam_eps, weight_decay=cfg.weight_decay)

    def kwargs(self) -> dict[str, Any]:
        return dict(lr=self.lr, betas=self.betas, eps=self.eps, weight_decay=self.weight_decay)


def build_optimizer(
    params: Iterable[torch.nn.Parameter], settings: AdamWSettings, param_dtype: torch.dtype
) -> torch.optim.Optimizer:
    """AdamW; fairseq's ``adam`` is AdamW too (decoupled weight decay on every parameter)."""
    params = [p for p in params if p.requires_grad]
    if param_dtype == torch.float16:
        logger.info("optimizer: AdamW with fp32 moments for the fp16 weights, one tensor at a time")
        return Fp32StateAdamW(params, **settings.kwargs())
    return torch.optim.AdamW(params, **adamw_kernel(params), **settings.kwargs())


def adamw_kernel(params: list[torch.nn.Parameter]) -> dict[str, bool]:
    """The keyword that picks torch AdamW's kernel for ``params``, and one log line naming it.

    For float32 parameters on the CPU (every precision mode but --memory-efficient-fp16 keeps
    its weights in float32) the fused kernel, one pass over each tensor, ran AdamW's step
    3-4x faster than the multi-tensor (foreach) one at 2.5M and 53M parameters, and agrees
    with it to rounding (tests/test_optim.py). Elsewhere the foreach kernel runs: on another
    device the fused one needs its step counters there, and ``init_optimizer_state`` keeps
    them on the host; in bfloat16 it rounds once where foreach rounds each operation, so the
    two runs would part.
    """
    devices = sorted({param.device.type for param in params})
    dtypes = sorted({str(param.dtype).removeprefix("torch.") for param in params})
    if devices == ["cpu"] and dtypes == ["float32"]:
        logger.info("optimizer: AdamW, torch's fused kernel (float32 parameters on the CPU)")
        return {"fused": True}
    logger.info("optimizer: AdamW, torch's foreach kernel (the fused one runs for float32 parameters on the CPU "
                "only; these are %s on %s)", ", ".join(dtypes) or "none", ", ".join(devices) or "no device")
    return {"foreach": True}


def init_optimizer_state(optimizer: torch.optim.Optimizer) -> None:
    """Allocate AdamW's state (step and both moments, zero) for every parameter that has none.

    The tensors are laid out as the optimizer's first step would lay them out (sharded
    like their DTensor parameters), so a checkpoint can be loaded into them in place.
    ``Fp32StateAdamW`` keeps fp32 moments; torch's AdamW keeps the parameter's dtype.
    """
    moment_dtype = torch.float32 if isinstance(optimizer, Fp32StateAdamW) else None
    for group in optimizer.param_groups:
        for param in group["params"]:
            state = optimizer.state[param]
            if state:
                continue
            state["step"] = torch.zeros((), dtype=torch.float32)
            state["exp_avg"] = torch.zeros_like(param, dtype=moment_dtype, memory_format=torch.preserve_format)
            state["exp_avg_sq"] = torch.zeros_like(param, dtype=moment_dtype, memory_format=torch.preserve_format)


class Fp32StateAdamW(torch.optim.Optimizer):
    """AdamW for fp16 weights with fp32 moments and no fp32 copy of the weights.

    This is ``--memory-efficient-fp16``: torch's AdamW keeps its moments in the
    parameter's dtype, and an fp16 second moment underflows (grad**2 < 6e-8 is zero),
    so the update is computed here in fp32, one tensor at a time, and written back
    to the fp16 weight. The only fp32 copy alive is that of one tensor.
    """

    def __init__(self, params, lr: float, betas: tuple[float, float], eps: float, weight_decay: float):
        super().__init__(params, dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay))

    def load_state_dict(self, state_dict: dict) -> None:
        # torch casts loaded state to each parameter's dtype (fp16 here), which would lose
        # exactly the fp32 moments this optimizer exists for; put them back from the saved copy.
        saved = state_dict["state"]
        super().load_state_dict(state_dict)
        # Saved ids map to parameters by position in the groups, as torch's own loader
        # maps them (ints from state_dict(), parameter names from torch.distributed.checkpoint).
        saved_ids = [i for group in state_dict["param_groups"] for i in group["params"]]
        params = [p for group in self.param_groups for p in group["params"]]
        for saved_id, param in zip(saved_ids, params):
            if saved_id in saved:
                for key in ("exp_avg", "exp_avg_sq"):
                    self.state[param][key] = saved[saved_id][key].to(param.device, torch.float32, copy=True)

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if not state:
                    state["step"] = torch.zeros((), dtype=torch.float32)
                    state["exp_avg"] = torch.zeros_like(p, dtype=torch.float32)
                    state["exp_avg_sq"] = torch.zeros_like(p, dtype=torch.float32)
                state["step"] += 1
                step = float(state["step"])
                grad = p.grad.float()
                weight = p.float()
                weight.mul_(1 - group["lr"] * group["weight_decay"])
                state["exp_avg"].lerp_(grad, 1 - beta1)
                state["exp_avg_sq"].mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
                denom = (state["exp_avg_sq"] / (1 - beta2**step)).sqrt_().add_(group["eps"])
                weight.addcdiv_(state["exp_avg"], denom, value=-group["lr"] / (1 - beta1**step))
                p.copy_(weight)


class LRSchedule:
    """Learning rate as a pure function of the number of updates, so resuming needs no state.

    Update ``n`` (1-based) uses ``lr_at(n)``. Warmup rises linearly from lr/warmup to lr,
    as fairseq's schedulers do; then polynomial decay or cosine runs to
    ``end_learning_rate`` at ``total_num_update``, or the rate stays fixed.
    """

    def __init__(self, cfg: OptimConfig, updates_in_run: int | None = None):
        self.kind = cfg.lr_scheduler
        self.peak = cfg.lr
        self.end = cfg.end_learning_rate
        self.power = cfg.power
        self.warmup = cfg.warmup_updates
        # Decay ends at --total-num-update, else --max-update, else where --max-epoch ends.
        self.total = cfg.total_num_update or cfg.max_update or updates_in_run

    def lr_at(self, update: int) -> float:
        if self.warmup > 0 and update <= self.warmup:
            return self.peak * update / self.warmup
        if self.kind == "fixed" or not self.total:
            return self.peak
        if update >= self.total:
            return self.end
        progress = (update - self.warmup) / max(1, self.total - self.warmup)
        if self.kind == "polynomial_decay":
            return (self.peak - self.end) * (1 - progress) ** self.power + self.end
        return self.end + 0.5 * (self.peak - self.end) * (1 + math.cos(math.pi * progress))

    def apply(self, optimizer: torch.optim.Optimizer, update: int) -> float:
        lr = self.lr_at(update)
        for group in optimizer.param_groups:
            group["lr"] = lr
        return lr
