"""What a model offers the trainer: the contract every distlm model, built in or the user's, meets.

A model is single-device code. The trainer and the strategies rely on the members of
``CONTRACT`` and nothing else, so parallelism can be applied from outside. A masked LM's
``forward(input_ids, masked_tokens=None)`` may compute logits at the masked positions
only; every model maps ``input_ids [B, T]`` to logits ``[B, T, V]``.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from distlm.choices import TASKS
from distlm.errors import UsageError

CONTRACT: dict[str, tuple[bool, str]] = {
    "task": (True, "which data pipeline and loss it trains with: one of choices.TASKS"),
    "init_weights": (True, "(re)initialise every parameter and buffer in place, drawing from torch's RNG only; "
                           "called after the model is materialised from the meta device"),
    "max_positions": (True, "the longest sample, in tokens, that the model accepts"),
    "padding_idx": (True, "the token id of padding (sequence parallel pads batches with it)"),
    "blocks": (False, "the nn.ModuleList of transformer blocks, the unit of FSDP sharding, activation "
                      "checkpointing and compilation; None: no per-block unit"),
    "tp_plan": (False, "module-name pattern -> tensor-parallel style (parallel/tp.py); empty: no tensor parallel"),
    "tp_divisible": (False, "config fields the tensor-parallel degree must divide"),
    "tp_kv_heads": (False, "the config field counting the key/value heads of colwise_kv projections; the "
                           "tensor-parallel degree must divide it or be a multiple of it"),
    "embed": (False, "for --pp-degree: forward in three parts, head(blocks(embed(ids), *block_args(ids)))"),
    "block_args": (False, "for --pp-degree: the extra inputs every block takes, from the input ids"),
    "head": (False, "for --pp-degree: the last part of forward, from the blocks' output to logits"),
    "embed_modules": (False, "for --pp-degree: the top-level modules embed uses (a module that head uses too "
                             "is a tied weight, kept on the first and the last stage)"),
    "head_modules": (False, "for --pp-degree: the top-level modules head uses"),
}
"""Member -> (required, what it is)."""

REQUIRED_MEMBERS = tuple(member for member, (required, _) in CONTRACT.items() if required)


class TransformerLM(nn.Module):
    """What distlm's own models share: blocks in ``self.layers``, the padding id in their
    config, and construction on the meta device.

    Subclasses build their modules inside ``with torch.device("meta")`` and then call
    ``materialise_unless_meta(device)``, so the torch RNG is consumed by ``init_weights``
    alone, the same way whether the model is built on a device or on meta and
    materialised later.
    """

    config: Any
    layers: nn.ModuleList

    @property
    def padding_idx(self) -> int:
        return self.config.padding_idx

    @property
    def blocks(self) -> nn.ModuleList:
        """The transformer blocks: the unit of FSDP sharding, activation checkpointing and compile."""
        return self.layers

    def materialise_unless_meta(self, device: torch.device) -> None:
        if device.type != "meta":
            self.to_empty(device=device)
            self.init_weights()


def allocate_meta_buffers(model: nn.Module, device: torch.device) -> None:
    """Give every buffer still on the meta device uninitialised storage on ``device``, where
    the parameters were allocated another way than ``to_empty`` of the whole model."""
    for module in model.modules():
        for name, buffer in module._buffers.items():
            if buffer is not None and buffer.is_meta:
                module._buffers[name] = torch.empty_like(buffer, device=device)


def check_model(model: object) -> None:
    """UsageError naming every member of the contract that ``model`` lacks or gets wrong."""
    name = type(model).__name__
    if not isinstance(model, nn.Module):
        raise UsageError(f"model={name} is not a torch.nn.Module; pass a module that maps input_ids to logits")
    missing = [member for member in REQUIRED_MEMBERS if not hasattr(model, member)]
    if missing:
        raise UsageError(
            f"model={name} lacks {', '.join(missing)} of the distlm model contract "
            f"({', '.join(REQUIRED_MEMBERS)}; see distlm/models/contract.py); add them"
        )
    if not callable(model.init_weights):
        raise UsageError(f"model={name}.init_weights is not callable; make it a method that initialises the weights")
    if model.task not in TASKS:
        raise UsageError(f"model={name}.task is {model.task!r}; it must be one of {', '.join(TASKS)}")
    blocks = model_blocks(model)
    if blocks is not None and not isinstance(blocks, nn.ModuleList):
        raise UsageError(f"model={name}.blocks is a {type(blocks).__name__}; it must be an nn.ModuleList or None")


def model_blocks(model: nn.Module) -> nn.ModuleList | None:
    """The model's transformer blocks, or None when it declares none."""
    return getattr(model, "blocks", None)


def model_tp_plan(model: nn.Module | type) -> dict[str, str]:
    """The declared tensor-parallel plan of a model (or model class); empty when it declares none.

    A model instance may declare a plan of its own (a Llama whose output is tied to its
    embedding splits differently from one that is not)."""
    return dict(getattr(model, "tp_plan", None) or {})
