"""A layout's recordings against the reference's: differences, tolerance, verdict, table.

A difference is relative: the largest absolute difference over a tensor divided by the
largest magnitude of the reference's tensor (a number's by its own magnitude), so one
tolerance serves embeddings, activations and losses alike.

The tolerance follows from the arithmetic; the reference computes in the layout's
precision, so what remains is the order of reductions and the dtype they are carried in.
In fp32 a layout adds the same numbers in another order (data-parallel gradient sums,
tensor-parallel partial sums, sharded norms); each sum moves by a few units in the last
place, and a few updates through a few blocks grow that to hundreds of units: the
tolerance is 2048 units of fp32 (2.4e-4). In bf16 or fp16 autocast, and where an fp16
or bf16 comm hook rounds every averaged gradient, one rounding to the low-precision
dtype differs where the fp32 sums under it differ at all: 8 units of that dtype (bf16
6.3e-2, fp16 7.8e-3).

Adam moves each element by about the learning rate whatever its gradient's size, so an
element whose gradient is of the order of Adam's epsilon, or whose gradient the
reduction order or a rounding changes in relative terms, moves differently by a share
of the learning rate that no relative tolerance of the parameter's magnitude bounds.
Parameters may therefore differ in addition by a multiple of the learning rates applied
so far: a quarter (llama_tiny under TP at lr 1e-3 with no warmup differed by 0.05 of
it), and twice where an fp16 or bf16 comm hook rounds the gradients (an fp16 all-reduce
flushes gradients below fp16's smallest number to zero, where the reference moves the
element by up to the learning rate: a flipped update). A broken shard or a skipped
reduction moves a block's output, the loss and the gradient norm by a sizeable fraction
of their magnitude, far beyond these.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import load_file

from distlm.choices import COMM_HOOK_KINDS
from distlm.precision import DTYPES, MODE_DTYPES

EPSILON = {name: torch.finfo(dtype).eps for name, dtype in DTYPES.items()}
# A mixture of experts' stacked experts (distlm/models/moe/model.py), expert first: each expert is
# compared, and named, on its own, so a report says which expert left the reference.
STACKED_EXPERTS = re.compile(r"(.+\.)?experts\.(gate_up_proj|down_proj)")


def units(dtype_name: str) -> int:
    """Units of the least precise dtype of a layout's arithmetic its results may differ by."""
    return 2048 if dtype_name == "fp32" else 8


@dataclass
class Tolerance:
    value: float
    """Relative difference allowed to every output, gradient, loss, gradient norm and parameter."""
    reason: str
    learning_rate_slack: float
    """Parameters may also differ by this many times the learning rates applied so far."""

    def describe(self) -> str:
        slack = f"; parameters also by {self.learning_rate_slack:g} x the learning rates so far (Adam)"
        return f"{self.value:.1e} relative ({self.reason}{slack})"


def tolerance_for(precision: str, comm_hook: str) -> Tolerance:
    """The tolerance of a layout computing in ``precision`` and reducing with ``comm_hook``."""
    dtypes = [MODE_DTYPES[precision].compute]
    wire = COMM_HOOK_KINDS[comm_hook].wire_dtype
    if wire is not None:
        dtypes.append(wire)
    coarsest = max(dtypes, key=EPSILON.__getitem__)
    because = f"{dtypes[0]} arithmetic" + (f", {comm_hook} gradient all-reduce" if wire else "")
    reason = f"{units(coarsest)} x {coarsest} epsilon: {because}, another reduction order"
    return Tolerance(units(coarsest) * EPSILON[coarsest], reason, 2.0 if wire else 0.25)


def expert_slices(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The recorded parameters, with each stacked expert tensor split into its experts,
    ``NAME[expert J]``, in place and in order."""
    result = {}
    for name, tensor in tensors.items():
        if STACKED_EXPERTS.fullmatch(name) and tensor.dim() == 3:
            result.update((f"{name}[expert {expert}]", tensor[expert]) for expert in range(len(tensor)))
        else:
            result[name] = tensor
    return result


def relative_difference(actual: torch.Tensor, expected: torch.Tensor) -> float:
    if actual.shape != expected.shape:
        return float("inf")
    scale = float(expected.abs().max()) if expected.numel() else 0.0
    diff = float((actual - expected).abs().max()) if expected.numel() else 0.0
    return diff / max(scale, 1e-12) if diff else 0.0


@dataclass
class StepComparison:
    step: int
    loss: float | None
    gnorm: float | None
    loss_difference: float | None
    gnorm_difference: float | None
    parameters: dict[str, float]
    """Parameter (each expert of a stacked expert tensor on its own, ``NAME[expert J]``) -> relative
    difference after this step (before the first update at step 0)."""
    parameter_slack: dict[str, float] = field(default_factory=dict)
    """Parameter -> the learning-rate slack of the tolerance, relative to its magnitude."""
    activations: dict[str, float] = field(default_factory=dict)
    """``output:MODULE`` / ``input_grad:MODULE`` -> largest relative difference over the micro-batches."""


def read_steps(directory: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in (directory / "steps.jsonl").read_text().splitlines() if line.strip()]


def merged_activations(directory: Path, step: int, reference: dict[str, torch.Tensor],
                       ranks_per_micro_batch: int = 1) -> dict[str, torch.Tensor]:
    """Every rank's recordings of ``step`` joined into whole tensors, shaped as the reference's.

    ``ranks_per_micro_batch`` > 1: a reference micro-batch holds that many data-parallel
    ranks' micro-batches, one after another along the batch (a mixture of experts' global
    micro-batch, one micro-batch per rank): rank r's micro-batch r is the reference's
    micro-batch 0, rows r x b onwards. The reference pads its micro-batch to its longest
    sample, a rank only to its own: positions a rank never computed (padding only the
    reference has) take the reference's values, so they compare equal.

    Data-parallel ranks hold different micro-batches (keys differ); tensor-parallel ranks
    hold the same micro-batch, each whole or its shard: shards are concatenated in
    tensor-parallel rank order along their recorded dimension, or, when none was recorded
    (sequence parallelism's plain local tensors), along the one dimension that makes the
    reference's shape. An input gradient of the reference's shape that differs between
    tensor-parallel ranks is a partial sum (the gradient reaching a column-parallel
    layer's input before its all-reduce): the parts are added.
    """
    parts: dict[str, dict[int, torch.Tensor]] = {}
    dims: dict[str, int] = {}
    for path in sorted((directory / "activations").glob(f"rank*_step{step}.safetensors")):
        with safe_open(str(path), "pt") as f:
            metadata = f.metadata() or {}
        tp_rank = int(metadata.get("tp_rank", 0))
        dims.update(json.loads(metadata.get("shard_dims", "{}")))
        for key, tensor in load_file(str(path)).items():
            parts.setdefault(key, {})[tp_rank] = tensor
    merged = {}
    for key, by_rank in parts.items():
        pieces = [by_rank[r] for r in sorted(by_rank)]
        expected = reference.get(key)
        if key in dims and len(pieces) > 1:
            merged[key] = torch.cat(pieces, dim=dims[key])
        elif key.startswith("input_grad:") and len(pieces) > 1 and all(
                p.shape == expected.shape for p in pieces) and any(not torch.equal(p, pieces[0]) for p in pieces):
            merged[key] = torch.stack(pieces).sum(0)
        elif expected is None or pieces[0].shape == expected.shape or len(pieces) == 1:
            merged[key] = pieces[0]
        else:
            merged[key] = _joined_like(pieces, expected.shape)
    if ranks_per_micro_batch > 1:
        grouped: dict[str, dict[int, torch.Tensor]] = {}
        for key, tensor in merged.items():
            name, _, micro = key.rpartition(":")
            grouped.setdefault(f"{name}:{int(micro) // ranks_per_micro_batch}", {})[int(micro)] = tensor
        merged = {key: _stacked_into(reference.get(key), [parts[m] for m in sorted(parts)])
                  for key, parts in grouped.items()}
    return merged


def _stacked_into(expected: torch.Tensor | None, pieces: list[torch.Tensor]) -> torch.Tensor:
    """``pieces`` one after another along the first dimension, each in the leading corner of
    its rows of a copy of ``expected``; an empty tensor (a shape mismatch, reported as
    infinitely different) when they do not fit in it."""
    if expected is None:
        return torch.empty(0)
    whole, row = expected.clone(), 0
    for piece in pieces:
        if piece.dim() != whole.dim() or any(a > b for a, b in zip(piece.shape[1:], whole.shape[1:])):
            return torch.empty(0)
        whole[(slice(row, row + len(piece)), *(slice(0, size) for size in piece.shape[1:]))] = piece
        row += len(piece)
    return whole if row == len(whole) else torch.empty(0)


def _joined_like(pieces: list[torch.Tensor], shape: torch.Size) -> torch.Tensor:
    for dim in range(len(shape)):
        if pieces[0].dim() == len(shape) and sum(p.shape[dim] for p in pieces) == shape[dim]:
            try:
                return torch.cat(pieces, dim=dim)
            except RuntimeError:
                continue
    return pieces[0]


def load_activations(directory: Path, step: int) -> dict[str, torch.Tensor]:
    """One process's recordings of ``step``, in the order they were made."""
    path = directory / "activations" / f"rank0_step{step}.safetensors"
    with safe_open(str(path), "pt") as f:
        order = json.loads((f.metadata() or {})["order"])
    tensors = load_file(str(path))
    return {key: tensors[key] for key in order}


def forward_order(keys: list[str]) -> list[str]:
    """``output:M`` and ``input_grad:M`` names in the order the reference recorded them,
    outputs first (each module's in forward order), then input gradients in the same
    module order."""
    modules: list[str] = []
    for key in keys:
        module = key.split(":")[1]
        if module not in modules:
            modules.append(module)
    kinds = ("output", "input_grad")
    present = {":".join(key.split(":")[:2]) for key in keys}
    return [f"{kind}:{module}" for kind in kinds for module in modules if f"{kind}:{module}" in present]


def compare_run(reference: Path, layout: Path, steps: int, activations: bool,
                tolerance: Tolerance, ranks_per_micro_batch: int = 1) -> list[StepComparison]:
    """The layout's recordings against the reference's, step 0 (initial weights) to ``steps``
    (``ranks_per_micro_batch``: see ``merged_activations``)."""
    ref_steps = {row["step"]: row for row in read_steps(reference)}
    lay_steps = {row["step"]: row for row in read_steps(layout)}
    result = []
    learning_rates = 0.0
    for step in range(steps + 1):
        ref_params = expert_slices(load_file(str(reference / "params" / f"step{step}.safetensors")))
        lay_params = expert_slices(load_file(str(layout / "params" / f"step{step}.safetensors")))
        params = {name: relative_difference(lay_params[name], tensor) if name in lay_params else float("inf")
                  for name, tensor in ref_params.items()}
        row = StepComparison(step, None, None, None, None, params)
        if step and ref_steps[step]["applied"]:
            learning_rates += ref_steps[step]["lr"]
        row.parameter_slack = {name: tolerance.learning_rate_slack * learning_rates / max(
            float(tensor.abs().max()), 1e-12) for name, tensor in ref_params.items()}
        if step:
            ref, lay = ref_steps[step], lay_steps[step]
            row.loss, row.gnorm = lay["loss"], lay["gnorm"]
            row.loss_difference = relative_difference(torch.tensor(lay["loss"]), torch.tensor(ref["loss"]))
            row.gnorm_difference = relative_difference(torch.tensor(lay["gnorm"]), torch.tensor(ref["gnorm"]))
        if step and activations:
            expected = load_activations(reference, step)
            actual = merged_activations(layout, step, expected, ranks_per_micro_batch)
            for key, tensor in expected.items():
                name = ":".join(key.split(":")[:2])
                diff = relative_difference(actual[key], tensor) if key in actual else float("inf")
                row.activations[name] = max(row.activations.get(name, 0.0), diff)
            row.activations = {name: row.activations[name] for name in forward_order(list(expected))}
        result.append(row)
    return result


def first_divergence(rows: list[StepComparison], tolerance: Tolerance) -> str | None:
    """Where the layout first leaves the reference: the step, and in it the first module in
    forward order whose output, then input gradient, differs; else the loss, the gradient
    norm, and the first parameter in the model's order. None: equal everywhere."""
    for row in rows:
        for key, diff in row.activations.items():
            if diff > tolerance.value:
                kind, module = key.split(":")
                what = "forward output" if kind == "output" else "input gradient"
                return f"step {row.step}: {what} of {module} differs by {diff:.2e}"
        for what, diff in (("loss", row.loss_difference), ("gradient norm", row.gnorm_difference)):
            if diff is not None and diff > tolerance.value:
                return f"step {row.step}: the {what} differs by {diff:.2e}" + _worst_parameter(row, tolerance)
        for name, diff in row.parameters.items():
            if diff > tolerance.value + row.parameter_slack.get(name, 0.0):
                when = "the initial weights" if row.step == 0 else "after the update"
                return f"step {row.step}: parameter {name} ({when}) differs by {diff:.2e}"
    return None


def _worst_parameter(row: StepComparison, tolerance: Tolerance) -> str:
    """``; parameter NAME differs most, by D`` of the parameters beyond the tolerance after the
    update whose loss or gradient norm differs (where that update took the layout), or ""."""
    beyond = {name: diff for name, diff in row.parameters.items()
              if diff > tolerance.value + row.parameter_slack.get(name, 0.0)}
    if not beyond:
        return ""
    name = max(beyond, key=beyond.__getitem__)
    return f"; parameter {name} differs most after it, by {beyond[name]:.2e}"


def markdown_table(results: list[dict[str, Any]]) -> str:
    """One row per layout and step: loss, gradient norm and the largest differences."""
    lines = ["| layout | step | loss | gnorm | loss diff | gnorm diff | largest parameter diff | largest activation diff |",
             "|---|---|---|---|---|---|---|---|"]
    for result in results:
        for row in result["steps"]:
            if row["step"] == 0:
                continue
            lines.append(
                f"| {result['layout']} | {row['step']} | {row['loss']:.6f} | {row['gnorm']:.6f} "
                f"| {_number(row['loss_difference'])} | {_number(row['gnorm_difference'])} | {_largest(row['parameters'])} "
                f"| {_largest(row['activations']) if row['activations'] else '-'} |"
            )
    return "\n".join(lines) + "\n"


def _largest(table: dict[str, float]) -> str:
    """The largest difference and where, e.g. ``9.3e-06 (layers.1.attention.wo.weight)``; ``0`` for none."""
    name = max(table, key=table.__getitem__, default=None)
    return f"{_number(table[name])} ({name.replace(':', ' of ').replace('input_grad', 'input gradient')})" if (
        name is not None and table[name] > 0) else "0"


def _number(value: float) -> str:
    return f"{value:.1e}" if value else "0"
