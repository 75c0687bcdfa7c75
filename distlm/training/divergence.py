"""Stopping a run that has diverged, and saying where.

Without a loss scaler (fp32, bf16) a non-finite gradient norm cannot recover by itself:
the run stops at once, naming the first parameter whose gradient is non-finite, in the
order the model registers them (which follows forward for distlm's models). With fp16 an overflow is skipped and the loss scale halves; when the scale
falls below ``--min-loss-scale`` or ``--fp16-max-skips`` updates in a row overflowed,
the failing update's micro-batches are run once more, one by one, with a hook on every
module (as fairseq's NanDetector does) to name the first module whose output or gradient
became non-finite.
"""

from __future__ import annotations

import contextlib
import warnings
from typing import Any, Callable, Iterator

import torch
import torch.distributed as dist
from torch import nn

from distlm.state.names import local_shard, parameter_names, single_device_name


class DivergenceError(FloatingPointError):
    """The run diverged; the message is one line naming the update and where it went non-finite."""



def _finite(tensor: torch.Tensor) -> bool:
    return bool(torch.isfinite(local_shard(tensor)).all())


def first_nonfinite_gradient(model: nn.Module, group: dist.ProcessGroup | None = None) -> str | None:
    """The single-device name of the first parameter (in registration order) whose gradient is
    non-finite on any rank, or None (collective over ``group`` when one is given)."""
    params = list(model.parameters())
    names = parameter_names(model)
    first = next((i for i, p in enumerate(params) if p.grad is not None and not _finite(p.grad)), len(params))
    if group is None:
        return names[first] if first < len(params) else None
    # Ranks holding the same parameters (replicas, tensor-parallel shards) compare indices;
    # pipeline stages hold different ones and come in rank order, which is stage order.
    everyone: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(everyone, (tuple(names), first), group=group)
    for held in dict.fromkeys(held for held, _ in everyone):
        index = min(i for other, i in everyone if other == held)
        if index < len(held):
            return held[index]
    return None


@contextlib.contextmanager
def recording_first_nonfinite(model: nn.Module) -> Iterator[list[str]]:
    """Hooks on every module that record, in the order they happen, the first module whose
    forward output or backward gradient is non-finite, as ``"forward output of NAME"``."""
    found: list[str] = []
    handles = []
    for name, module in model.named_modules():
        name = single_device_name(name) or "the model"

        def forward_hook(module, args, output, name=name):
            if not found and any(not _finite(t) for t in _tensors(output)):
                found.append(f"forward output of {name} ({type(module).__name__})")

        def backward_hook(module, grad_input, grad_output, name=name):
            if not found and any(not _finite(t) for t in _tensors(grad_input)):
                found.append(f"gradient of {name} ({type(module).__name__})")

        handles.append(module.register_forward_hook(forward_hook))
        handles.append(module.register_full_backward_hook(backward_hook))
    try:
        yield found
    finally:
        for handle in handles:
            handle.remove()


def _tensors(value) -> list[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return [value] if value.is_floating_point() else []
    if isinstance(value, (list, tuple)):
        return [t for item in value for t in _tensors(item)]
    if isinstance(value, dict):
        return [t for item in value.values() for t in _tensors(item)]
    return []


def locate_nonfinite(model: nn.Module, batches: list[dict[str, torch.Tensor]], loss_of: Callable,
                     scale: torch.Tensor, gather: Callable[[object], list]) -> str:
    """Run the failing update's micro-batches forward and backward again with hooks, one at a
    time, until some rank finds where its output or gradient first went non-finite; that
    place, as rank 0 reports it (collective: every rank reruns its own micro-batches in
    step, so backward's collectives pair up, and all stop after the same one)."""
    for index, batch in enumerate(batches):
        with recording_first_nonfinite(model) as found, warnings.catch_warnings():
            # Hooks on modules whose inputs need no gradient (the embeddings) fire on their outputs.
            warnings.filterwarnings("ignore", message="Full backward hook is firing")
            loss = loss_of(batch)
            (loss * scale).backward()
        model.zero_grad(set_to_none=True)
        places = gather(found[0] if found else None)
        for rank, place in enumerate(places):
            if place is None:
                continue
            where = f" in micro-batch {index + 1} of {len(batches)}" if len(batches) > 1 else ""
            return f"{place}{where} on rank {rank}" if len(places) > 1 else f"{place}{where}"
    return "no module's output or gradient (the loss scale itself overflowed)"
