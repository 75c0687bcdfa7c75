"""One parity run: the reference (one process) or a layout, as the driver starts it:

    python -m distlm.parity.worker SPEC.json
    python -m torch.distributed.run --nproc_per_node N --standalone -m distlm.parity.worker SPEC.json

It trains with distlm's Trainer and records what the driver compares, under the
single-device names: the whole parameters before the first update and after every
one (rank 0, ``params/step<k>.safetensors``), each update's loss and gradient norm
(``steps.jsonl``) and, with ``activations``, the forward output and input gradient of
every top-level module and block for each micro-batch (every rank its own part,
``activations/rank<r>_step<k>.safetensors``).
"""

from __future__ import annotations

import contextlib
import importlib
import inspect
import json
import math
import os
import sys
from pathlib import Path
from typing import Any, Callable, Iterator

import torch
import torch.distributed as dist
from safetensors.torch import save_file
from torch import nn
from torch.distributed.tensor import DTensor, Shard

from distlm.config import TrainConfig, parse_args
from distlm.errors import UsageError, exit_without_teardown, rank_from_environment, report_usage_error
from distlm.models.contract import model_blocks
from distlm.runtime.context import shutdown
from distlm.state.full import full_state_dict
from distlm.state.names import local_shard, parameter_names, single_device_name, unwrap
from distlm.training.trainer import Trainer

ERROR_PREFIX = "distlm.parity: error: "
PERTURB_VARIABLE = "DISTLM_PARITY_PERTURB"
"""For testing the tool itself: ``RUN:STEP:PARAMETER:RANK:DELTA`` makes the run recorded in
the directory named RUN add DELTA to RANK's local shard of PARAMETER (single-device
name) before update STEP, as a broken layout would."""


def load_user_model(target: str, config: TrainConfig) -> nn.Module:
    """``package.module:function``'s model; the function takes no argument or the TrainConfig."""
    build = model_builder(target)
    # Every process must build the same weights.
    torch.manual_seed(config.seed)
    model = build(config) if inspect.signature(build).parameters else build()
    if not isinstance(model, nn.Module):
        raise UsageError(f"--model {target}: it returned a {type(model).__name__}, not an nn.Module")
    return model


def model_builder(target: str) -> Callable:
    """The function ``package.module:function`` names; UsageError naming what is wrong."""
    module_name, sep, function_name = target.partition(":")
    if not sep or not module_name or not function_name:
        raise UsageError(f"--model {target}: write package.module:function")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise UsageError(f"--model {target}: cannot import {module_name} ({exc}); check the name and PYTHONPATH") from None
    build = getattr(module, function_name, None)
    if not callable(build):
        raise UsageError(f"--model {target}: {module_name} has no function {function_name}")
    return build


class ParityTrainer(Trainer):
    """The Trainer, recording after each update; the loop itself is the Trainer's."""

    def __init__(self, config: TrainConfig, out: Path, activations: bool, model: nn.Module | None = None,
                 stale: bool = False):
        super().__init__(config, model=model)
        for module in self.model.modules():
            if isinstance(module, nn.Dropout):
                module.p = 0.0  # dropout masks differ with the layout; parity compares without them
        if stale:
            StaleGradients(self.handle)
        self.out = out
        self.calls = 0
        self.perturb = _perturbation(out.name)
        # Each data-parallel rank's backward starts from its loss times dp (the strategies
        # average gradients over the replicas): its input gradients are dp times the reference's.
        self.recorder = ActivationRecorder(unwrap(self.model), 1 / self.ctx.dims.dp) if activations else None
        self.tp_rank = dist.get_rank(self.ctx.tp_group) if self.ctx.tp_group is not None else 0
        if self.ctx.is_main:
            (out / "params").mkdir(parents=True, exist_ok=True)
            (out / "steps.jsonl").write_text("")
        if activations:
            (out / "activations").mkdir(parents=True, exist_ok=True)
        self.write_parameters(0)

    def train_step(self, micro_batches: list[dict[str, Any]]) -> dict[str, Any]:
        self.calls += 1
        self.apply_perturbation()
        # Micro-batch j of data-parallel rank r is micro-batch r * U + j of the global batch.
        first = self.ctx.dp_rank * len(micro_batches)
        with self.recorder.recording(first) if self.recorder else contextlib.nullcontext():
            record = super().train_step(micro_batches)
        self.write_step(record)
        return record

    def apply_perturbation(self) -> None:
        if self.perturb is None or self.perturb[0] != self.calls or self.perturb[2] != self.ctx.rank:
            return
        _, name, _, delta = self.perturb
        for param_name, param in zip(parameter_names(self.model), self.model.parameters()):
            if param_name == name:
                with torch.no_grad():
                    local_shard(param).add_(delta)

    def write_step(self, record: dict[str, Any]) -> None:
        totals = torch.tensor([float(record["loss_sum"]), float(record["target_tokens"])], dtype=torch.float64,
                              device=self.ctx.device)
        if self.ctx.dp_group is not None:
            dist.all_reduce(totals, group=self.ctx.dp_group)
        if self.recorder is not None:
            name = f"rank{self.ctx.rank}_step{self.calls}.safetensors"
            tensors, shard_dims = self.recorder.take()
            save_file(tensors, str(self.out / "activations" / name),
                      metadata={"tp_rank": str(self.tp_rank), "shard_dims": json.dumps(shard_dims),
                                "order": json.dumps(list(tensors))})
        self.write_parameters(self.calls)
        if self.ctx.is_main:
            # In bits per target token, as distlm.train logs it.
            loss = float(totals[0] / totals[1].clamp(min=1)) / math.log(2)
            line = {"step": self.calls, "loss": loss, "gnorm": record["gnorm"],
                    "applied": record["applied"], "lr": record["lr"]}
            with open(self.out / "steps.jsonl", "a") as f:
                f.write(json.dumps(line) + "\n")

    def write_parameters(self, step: int) -> None:
        """The whole parameters under their single-device names (collective; rank 0 writes)."""
        names = set(parameter_names(self.model))
        dims = self.ctx.dims
        # A pipeline rank holds its stages' parameters: every rank consolidates its own, and
        # rank 0 gathers them over the pipeline.
        state = full_state_dict(self.model, rank0_only=not dims.pp_enabled)
        tensors = {name: t.detach().float().cpu().contiguous().clone() for name, t in state.items() if name in names}
        if dims.pp_enabled:
            parts: list[Any] = [None] * dims.pp
            dist.all_gather_object(parts, tensors, group=dims.pp_group(self.ctx.device.type))
            tensors = {name: tensor for part in parts for name, tensor in part.items()}
        if self.ctx.is_main:
            save_file(tensors, str(self.out / "params" / f"step{step}.safetensors"))


class StaleGradients:
    """Double buffering in one process: update k applies the gradients of update k-1's
    batch and the first update applies nothing, as ``--double-buffering`` does across
    replicas. The reference of a double-buffered layout is stale by construction."""

    def __init__(self, handle: Any):
        self.previous: list[torch.Tensor | None] | None = None
        self.first_step = True
        clip = handle.unscale_and_clip_
        params = list(handle.model.parameters())

        def stale_unscale_and_clip_(loss_scale: float, max_norm: float) -> torch.Tensor:
            current = [p.grad for p in params]
            self.first_step = self.previous is None
            for param, grad in zip(params, self.previous or [None if g is None else torch.zeros_like(g) for g in current]):
                param.grad = grad
            self.previous = current
            return clip(loss_scale, max_norm)

        handle.unscale_and_clip_ = stale_unscale_and_clip_
        handle.double_buffer = self

    def wait_pending(self) -> None:
        pass


def _perturbation(run: str) -> tuple[int, str, int, float] | None:
    text = os.environ.get(PERTURB_VARIABLE, "")
    target, _, rest = text.partition(":")
    if target != run:
        return None
    step, name, rank, delta = rest.split(":")
    return int(step), name, int(rank), float(delta)


class ActivationRecorder:
    """Forward outputs and input gradients of the model's top-level modules and blocks,
    by single-device name, per micro-batch of the global batch.

    Each rank records what it holds: a sharded output is kept as this rank's shard with
    the dimension it is split along (a DTensor's placement; under sequence parallelism
    plain tensors are sequence shards, which the driver recognises by their shape). The
    hooks run eagerly, outside any compiled graph (a graph break per hooked block).
    """

    def __init__(self, root: nn.Module, gradient_scale: float = 1.0):
        self.modules = _hooked_modules(root)
        self.gradient_scale = gradient_scale
        self.tensors: dict[str, torch.Tensor] = {}
        self.shard_dims: dict[str, int] = {}
        self.micro = 0

    @contextlib.contextmanager
    def recording(self, first_micro_batch: int) -> Iterator[None]:
        handles = []
        self.micro = first_micro_batch - 1
        root = self.modules[0][1]
        handles.append(root.register_forward_pre_hook(torch._dynamo.disable(self._next_micro_batch)))
        for name, module in self.modules[1:]:
            handles.append(module.register_forward_pre_hook(torch._dynamo.disable(self._input_hook(name))))
            handles.append(module.register_forward_hook(torch._dynamo.disable(self._output_hook(name))))
        try:
            yield
        finally:
            for handle in handles:
                handle.remove()

    def _next_micro_batch(self, module, args) -> None:
        self.micro += 1

    def _store(self, kind: str, name: str, tensor: torch.Tensor) -> None:
        key = f"{kind}:{name}:{self.micro}"
        if isinstance(tensor, DTensor):
            shard = next((p.dim for p in tensor.placements if isinstance(p, Shard)), None)
            if shard is not None:
                self.shard_dims[key] = shard
            tensor = tensor.to_local()
        self.tensors[key] = tensor.detach().float().cpu().contiguous().clone()

    def _output_hook(self, name: str) -> Callable:
        def hook(module, args, output) -> None:
            tensor = _first_float(output)
            if tensor is not None:
                self._store("output", name, tensor)

        return hook

    def _input_hook(self, name: str) -> Callable:
        def hook(module, args) -> None:
            tensor = _first_float(args)
            if tensor is not None and tensor.requires_grad:
                micro = self.micro
                tensor.register_hook(lambda grad: self._store_gradient(name, micro, grad))

        return hook

    def _store_gradient(self, name: str, micro: int, grad: torch.Tensor) -> None:
        current, self.micro = self.micro, micro
        self._store("input_grad", name, grad * self.gradient_scale)
        self.micro = current

    def take(self) -> tuple[dict[str, torch.Tensor], dict[str, int]]:
        tensors, dims = self.tensors, self.shard_dims
        self.tensors, self.shard_dims = {}, {}
        return tensors, dims


def _hooked_modules(root: nn.Module) -> list[tuple[str, nn.Module]]:
    """The root, then its top-level modules with each block in place of the block list."""
    blocks = model_blocks(root)
    found = [("", root)]
    for name, child in root.named_children():
        if blocks is not None and child is blocks:
            found += [(single_device_name(f"{name}.{index}"), block) for index, block in child.named_children()]
        else:
            found.append((single_device_name(name), child))
    return [(name, module) for name, module in found if name or module is root]


def _first_float(value) -> torch.Tensor | None:
    if isinstance(value, torch.Tensor):
        return value if value.is_floating_point() else None
    if isinstance(value, (list, tuple)):
        return next((t for t in map(_first_float, value) if t is not None), None)
    return None


def main(argv: list[str]) -> int:
    rank = rank_from_environment()
    try:
        spec = json.loads(Path(argv[0]).read_text())
        config = parse_args(spec["flags"])
        model = load_user_model(spec["model"], config) if spec.get("model") else None
        torch.use_deterministic_algorithms(True, warn_only=True)
        ParityTrainer(config, Path(spec["out"]), spec["activations"], model, spec.get("stale_reference", False)).fit()
    except UsageError as exc:
        return report_usage_error(ERROR_PREFIX, exc, rank)
    finally:
        shutdown()
    return 0


if __name__ == "__main__":
    exit_without_teardown(main(sys.argv[1:]))
