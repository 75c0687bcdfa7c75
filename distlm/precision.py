"""Numeric precision: fp32, bf16 autocast, fp16 autocast, and fp16 without an fp32 weight copy.

fp16 needs dynamic loss scaling: the loss is multiplied by a scale before backward so
small gradients do not flush to zero, gradients are divided by it before the update,
and an update whose gradients overflowed is skipped while the scale halves. torch's
``GradScaler`` refuses fp16 gradients (which ``--memory-efficient-fp16`` has), so both
fp16 modes share the small scaler below, with fairseq's semantics.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Iterator

import torch

from distlm.errors import UsageError

DTYPES: dict[str, torch.dtype] = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
"""The floating-point types distlm computes and communicates in, by their short names."""

_DTYPE_SPELLINGS = {
    "float32": "fp32", "float": "fp32", "bfloat16": "bf16", "float16": "fp16", "half": "fp16",
    **{str(dtype): name for name, dtype in DTYPES.items()}, **{name: name for name in DTYPES},
}


def dtype_name(dtype: object) -> str:
    """``fp32``, ``bf16`` or ``fp16`` for a torch dtype or one of their usual spellings."""
    key = str(dtype).lower()
    if key not in _DTYPE_SPELLINGS:
        raise UsageError(f"precision {dtype} is unknown; choose one of {', '.join(DTYPES)}")
    return _DTYPE_SPELLINGS[key]


@dataclass(frozen=True)
class ModeDtypes:
    """The dtypes of one precision mode."""

    param: torch.dtype
    """The weights (and the optimizer's view of them)."""
    autocast: torch.dtype | None
    """Forward and backward run under autocast to this type; None: no autocast. FSDP
    casts its unsharded parameters to it instead."""
    fsdp_reduce: torch.dtype | None
    """FSDP reduce-scatters gradients in this type; None: the parameters' type. Always
    fp32 where a half type is involved: a summed fp16 gradient could overflow."""

    @property
    def compute(self) -> str:
        """The matmuls' type, the one whose peak FLOP/s an MFU divides by."""
        return dtype_name(self.autocast or self.param)

    @property
    def compute_bytes(self) -> int:
        """Bytes of one element in the matmuls' type: activations, and FSDP's gathered parameters."""
        return (self.autocast or self.param).itemsize


MODE_DTYPES: dict[str, ModeDtypes] = {
    "fp32": ModeDtypes(param=torch.float32, autocast=None, fsdp_reduce=None),
    "bf16": ModeDtypes(param=torch.float32, autocast=torch.bfloat16, fsdp_reduce=torch.float32),
    "fp16": ModeDtypes(param=torch.float32, autocast=torch.float16, fsdp_reduce=torch.float32),
    "memory_efficient_fp16": ModeDtypes(
        param=torch.float16, autocast=None, fsdp_reduce=torch.float32
    ),
}
"""Precision mode (each of ``choices.PRECISIONS``) -> its dtypes; everything else derives from it."""


def precision_flags(mode: str) -> list[str]:
    """The command-line flags that select ``mode`` (fp32 is the default and needs none)."""
    return [] if mode == "fp32" else ["--" + mode.replace("_", "-")]


def computes_in_fp16(mode: str) -> bool:
    """The modes whose arithmetic is fp16: they scale the loss (small fp16 gradients flush
    to zero), and devices without fast fp16 refuse them."""
    return MODE_DTYPES[mode].compute == "fp16"


class DynamicLossScaler:
    """Halve the scale on overflow; double it after ``scale_window`` clean updates.

    A run whose scale falls below ``min_scale``, or that overflows ``max_skips`` updates
    in a row, has diverged: ``update`` raises ``FloatingPointError``.
    """

    def __init__(self, init_scale: float, scale_window: int, min_scale: float, factor: float = 2.0,
                 max_skips: int | None = None):
        self.scale = float(init_scale)
        self.scale_window = scale_window
        self.min_scale = min_scale
        self.factor = factor
        self.max_skips = max_skips
        self._clean_updates = 0
        self.consecutive_skips = 0

    def update(self, overflow: bool) -> None:
        if overflow:
            self.scale /= self.factor
            self._clean_updates = 0
            self.consecutive_skips += 1
            if self.scale < self.min_scale:
                raise FloatingPointError(
                    f"fp16 loss scale fell below --min-loss-scale {self.min_scale}: the loss is diverging; "
                    "lower --lr or use --bf16/fp32"
                )
            if self.max_skips is not None and self.consecutive_skips >= self.max_skips:
                raise FloatingPointError(
                    f"{self.consecutive_skips} fp16 updates in a row overflowed (--fp16-max-skips {self.max_skips}): "
                    "the loss is diverging; lower --lr or use --bf16/fp32"
                )
            return
        self.consecutive_skips = 0
        self._clean_updates += 1
        if self._clean_updates % self.scale_window == 0:
            self.scale *= self.factor

    def state_dict(self) -> dict[str, float | int]:
        return {"scale": self.scale, "clean_updates": self._clean_updates, "consecutive_skips": self.consecutive_skips}

    def load_state_dict(self, state: dict[str, float | int]) -> None:
        self.scale = float(state["scale"])
        self._clean_updates = int(state["clean_updates"])
        # --fp16-max-skips counts overflows in a row across a resume; earlier checkpoints lack the count.
        self.consecutive_skips = int(state.get("consecutive_skips", 0))


@dataclass
class Precision:
    """What one precision mode means for weights, forward, and the gradient scale."""

    mode: str  # fp32 | bf16 | fp16 | memory_efficient_fp16
    scaler: DynamicLossScaler | None = None

    @classmethod
    def from_mode(cls, mode: str, init_scale: float = 128.0, scale_window: int = 256, min_scale: float = 1e-4,
                  max_skips: int | None = None):
        scaler = DynamicLossScaler(init_scale, scale_window, min_scale, max_skips=max_skips) \
            if computes_in_fp16(mode) else None
        return cls(mode, scaler)

    @classmethod
    def from_config(cls, mode: str, settings) -> "Precision":
        """From the precision mode and a ``PrecisionConfig`` (loss-scaler settings)."""
        return cls.from_mode(mode, settings.fp16_init_scale, settings.fp16_scale_window, settings.min_loss_scale,
                             settings.fp16_max_skips)

    @property
    def param_dtype(self) -> torch.dtype:
        """fp16 weights only for memory-efficient fp16; every other mode keeps fp32 weights."""
        return MODE_DTYPES[self.mode].param

    @property
    def autocast_dtype(self) -> torch.dtype | None:
        return MODE_DTYPES[self.mode].autocast

    @property
    def loss_scale(self) -> float:
        return self.scaler.scale if self.scaler is not None else 1.0

    @contextlib.contextmanager
    def autocast(self, device_type: str, enabled: bool = True) -> Iterator[None]:
        """Autocast to the mode's half type; ``enabled=False`` where the strategy casts itself (FSDP).

        bf16 on a CPU also keeps SDPA's math backend in bf16 (``bf16_math_attention``), cast
        by autocast or by the strategy alike.
        """
        with contextlib.ExitStack() as stack:
            if self.autocast_dtype == torch.bfloat16 and device_type == "cpu":
                stack.enter_context(bf16_math_attention())
            if self.autocast_dtype is not None and enabled:
                stack.enter_context(torch.autocast(device_type=device_type, dtype=self.autocast_dtype))
            yield


@contextlib.contextmanager
def bf16_math_attention() -> Iterator[None]:
    """Let SDPA's math backend compute bf16 attention in bf16 while the context is open.

    A CPU has no fused SDPA kernel for attention with dropout (RoBERTa's default
    attention dropout, 0.1, in training): SDPA runs its math backend, which by default
    upcasts bf16 queries, keys and values to fp32 and so runs no faster than fp32. In
    bf16 its scores and probabilities round to bf16 (fp32's exponent range, so nothing
    overflows) and its matrix multiplies take the CPU's bf16 kernels. The flag is read when
    the forward records the math backend's operations, so backward follows the forward's
    choice; the fused kernels, used without dropout, never read it.
    """
    previous = torch.backends.cuda.fp16_bf16_reduction_math_sdp_allowed()
    torch.backends.cuda.allow_fp16_bf16_reduction_math_sdp(True)
    try:
        yield
    finally:
        torch.backends.cuda.allow_fp16_bf16_reduction_math_sdp(previous)
