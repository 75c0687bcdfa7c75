"""Measure one world size on every rank: each strategy's update split into its parts, and the all-reduce.

An update is timed whole (``step``), and inside it the gradient unscale, clip and
optimizer step (``optimizer``). Where data parallelism communicates, every timed update
is paired with one that runs the same batch with that communication switched off
(``communication_off``), in alternating order; that update's time less its optimizer
part is the compute. What the full update takes beyond compute and optimizer is the
communication that compute did not hide.
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import math
import os
import statistics
import time
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any, Callable, Iterator, Sequence

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import Shard, distribute_tensor

from distlm.backends.hardware import device_peak_flops, host_cores, measure_cpu_matmul_flops
from distlm.choices import PROBE_METHODS
from distlm.config import TrainConfig, parse_args
from distlm.errors import UsageError
from distlm.layout import Layout
from distlm.optim import AdamWSettings, build_optimizer
from distlm.parallel import comm_hooks
from distlm.precision import dtype_name, precision_flags
from distlm.state.names import unwrap
from distlm.training.trainer import Trainer

# The suite drives a fixed number of updates and never stops on its own, validates or logs.
_NEVER = 10**9
KIB, MIB = 1024, 1024 * 1024


@dataclass
class LaunchSpec:
    """What one launch measures; the driver writes it as JSON for the ranks to read (``to_json``)."""

    arch: str
    strategies: list[str]
    batch_size: int
    """Samples per micro-batch per data-parallel replica at this world size."""
    update_freq: int
    tokens_per_sample: int
    precision: str
    """fp32, bf16 or fp16."""
    device: str
    steps: int
    warmup_steps: int
    layout: Layout = field(default_factory=Layout)
    """distlm.train's layout: the comm hook, buckets, tensor- and pipeline-parallel degrees and
    the pipeline's settings (given only above pp 1); its strategy is each of ``strategies`` in turn."""
    data: str | None = None
    """distlm.train's --data; None: the built-in corpus."""
    allreduce_sizes: list[int] = field(default_factory=list)
    """fp32 buffer sizes in bytes for the plain all-reduce probe (empty: no probe)."""
    seed: int = 1
    concurrent_processes: int = 1
    """One-rank launches that run at once on this host (``HostSharing``); 1: this one alone."""
    rendezvous_dir: str | None = None
    """Where the concurrent launches meet (``HostSharing``)."""

    def to_json(self) -> dict[str, Any]:
        """The spec as one flat JSON object: its own fields and the layout's settings under
        distlm.train's names (``tp_degree``, ``comm_hook``, ``pp_schedule``...), which the raw
        results keep; the strategies measured are the spec's list, not the layout's one."""
        own = {f.name: getattr(self, f.name) for f in fields(self) if f.name != "layout"}
        settings = {name: value for name, value in self.layout.settings().items() if name != "strategy"}
        return {**own, **settings}

    @classmethod
    def from_json(cls, values: dict[str, Any]) -> LaunchSpec:
        """The spec of ``to_json``'s object."""
        own = {f.name: values[f.name] for f in fields(cls) if f.name != "layout" and f.name in values}
        return cls(**own, layout=Layout.from_settings(values))

    def trainer_flags(self, strategy: str) -> list[str]:
        """distlm.train's flags for ``strategy``: fixed-length samples, nothing saved or validated."""
        layout, pipeline = self.layout, self.layout.pipeline
        flags = [
            "--arch", self.arch, "--strategy", strategy, "--tp-degree", str(layout.tp_degree),
            "--batch-size", str(self.batch_size), "--update-freq", str(self.update_freq),
            "--tokens-per-sample", str(self.tokens_per_sample),
            # Every sample exactly --tokens-per-sample tokens, so tokens/s and FLOPs are what they say.
            "--sample-break-mode", "none",
            "--comm-hook", layout.comm_hook, "--bucket-cap-mb", str(layout.bucket_cap_mb), "--device", self.device,
            "--no-save", "--disable-validation", "--max-update", str(_NEVER), "--log-interval", str(_NEVER),
            "--seed", str(self.seed),
        ]
        flags += ["--data", self.data] if self.data is not None else []
        if layout.pp_degree > 1:
            flags += ["--pp-degree", str(layout.pp_degree), "--pp-schedule", pipeline.schedule,
                      "--pp-microbatches", str(pipeline.microbatches),
                      "--pp-stages-per-rank", str(pipeline.stages_per_rank)]
        return flags + precision_flags(self.precision)

    def trainer_config(self, strategy: str) -> TrainConfig:
        """The parsed and checked config of ``trainer_flags``."""
        return parse_args(self.trainer_flags(strategy))


# ------------------------------------------------------------------------------- hooks


class UpdateClock:
    """Seconds an update spends in gradient unscale + clip and in the optimizer step.

    The trainer has no timing hook, so the two calls it makes are wrapped on the
    instances: the handle's ``unscale_and_clip_`` and the optimizer's ``step``.
    """

    def __init__(self, trainer: Any):
        self.seconds = 0.0
        trainer.handle.unscale_and_clip_ = self._timed(trainer.handle.unscale_and_clip_)
        trainer.optimizer.step = self._timed(trainer.optimizer.step)

    def _timed(self, call: Callable) -> Callable:
        def timed(*args: Any, **kwargs: Any) -> Any:
            start = time.perf_counter()
            try:
                return call(*args, **kwargs)
            finally:
                self.seconds += time.perf_counter() - start

        return timed


@contextlib.contextmanager
def communication_off(trainer: Any) -> Iterator[None]:
    """Run updates inside with no data-parallel communication and the same compute.

    Gradients are not synchronised on any micro-batch (DDP's ``no_sync``, FSDP2's
    ``requires_gradient_sync``). FSDP2 would still all-gather parameters before each
    block's forward and backward, so they are gathered once on entering (outside any
    timing) and held: no block reshards after forward or backward. On leaving, FSDP's
    settings come back, the unsynchronised gradients are dropped and the parameters are
    resharded. Inside, DDP replicas step on their own gradients and drift apart, and
    FSDP's sharded parameters get no gradients: the weights are not the point here.
    """
    handle = trainer.handle
    sync = handle.gradient_sync
    handle.gradient_sync = lambda enabled: sync(False)
    fsdp_modules = [module for module in trainer.model.modules() if isinstance(module, FSDPModule)]
    groups = [group for module in fsdp_modules for group in module._get_fsdp_state()._fsdp_param_groups]
    saved = [(g.post_forward_mesh_info, g.reshard_after_backward, g.reduce_grads, g.all_reduce_grads) for g in groups]
    try:
        for group in groups:
            group.post_forward_mesh_info = None  # no reshard after forward
            group.reshard_after_backward = False
            group.reduce_grads = group.all_reduce_grads = False
        for module in fsdp_modules:
            module.unshard()
        yield
    finally:
        del handle.gradient_sync  # back to the class's method
        for group, (post_forward, after_backward, reduce, all_reduce) in zip(groups, saved):
            for param in group.fsdp_params:
                param.unsharded_accumulated_grad = None
                if hasattr(param, "_unsharded_param"):
                    param.unsharded_param.grad = None
            group.post_forward_mesh_info = post_forward
            group.reshard_after_backward = after_backward
            group.reduce_grads, group.all_reduce_grads = reduce, all_reduce
        for module in fsdp_modules:
            module.reshard()


# --------------------------------------------------------------------------- measuring


class HostSharing:
    """Keeps ``processes`` independent one-rank launches timing at the same time.

    The launches share nothing but the host: each times its updates only once all of
    them have warmed up, and keeps running untimed updates until all have finished
    timing, so every timed update runs with the others' compute beside it. They meet
    through files in ``directory`` (one per launch and stage), which needs no process
    group. A launch that never arrives ends the wait after ``timeout_s`` with an error.
    """

    def __init__(self, directory: str | None, processes: int, timeout_s: float = 900.0):
        self.directory = None if directory is None else Path(directory)
        self.processes = processes
        self.timeout_s = timeout_s
        self.name = f"{os.getpid()}"

    @property
    def shared(self) -> bool:
        return self.directory is not None and self.processes > 1

    def arrive(self, stage: str) -> None:
        if self.shared:
            (self.directory / f"{stage}.{self.name}").touch()

    def everyone(self, stage: str) -> bool:
        return not self.shared or len(list(self.directory.glob(f"{stage}.*"))) >= self.processes

    def wait(self, stage: str, keep_busy: Callable[[], None] = lambda: time.sleep(0.01)) -> None:
        """Arrive at ``stage`` and run ``keep_busy`` until every launch has arrived."""
        self.arrive(stage)
        deadline = time.monotonic() + self.timeout_s
        while not self.everyone(stage):
            if time.monotonic() > deadline:
                raise RuntimeError(
                    f"{self.processes} concurrent one-rank launches: only "
                    f"{len(list(self.directory.glob(f'{stage}.*')))} reached {stage!r} within {self.timeout_s:.0f} s"
                )
            keep_busy()


@dataclass
class StrategyTimes:
    """One strategy at one world size, one launch: per timed update, the slowest rank's
    update seconds and the ranks' mean optimizer seconds; ``compute_*`` empty where
    nothing communicates (one data-parallel replica)."""

    strategy: str
    world_size: int
    dp_degree: int
    vocab_size: int
    step_s: list[float]
    optimizer_s: list[float]
    compute_step_s: list[float]
    compute_optimizer_s: list[float]
    memory: list[dict[str, int]]
    """``distlm.training.memory.memory_report`` of every rank after an update, in rank order."""
    device: str
    ranks_per_node: int
    optimizer_plain_s: list[float] = field(default_factory=list)
    optimizer_dtensor_s: list[float] = field(default_factory=list)
    """One rank only: ``time_optimizer_on_dtensors``' rounds."""


def timed_update(trainer: Any, micro_batches: list[dict[str, Any]], clock: UpdateClock) -> tuple[float, float]:
    """(update seconds, optimizer seconds) of one ``train_step``, started together on every rank."""
    trainer.ctx.barrier()
    clock.seconds = 0.0
    start = time.perf_counter()
    trainer.train_step(micro_batches)
    trainer.ctx.backend.synchronize()
    return time.perf_counter() - start, clock.seconds


def measure_strategy(
    spec: LaunchSpec, strategy: str, progress: Callable[[str], None] = lambda line: None
) -> StrategyTimes:
    """Build a Trainer for ``strategy``, warm it up, then time ``spec.steps`` updates
    (each paired with one with communication off, where there is communication)."""
    trainer = Trainer(spec.trainer_config(strategy))
    ctx = trainer.ctx
    loader = trainer.update_batches()
    # Data loading is not part of an update here: the batches are collated beforehand.
    batches = [next(loader) for _ in range(max(1, min(spec.steps, 4)))]
    clock = UpdateClock(trainer)
    communicates = ctx.dims.dp_enabled
    never_logged = trainer.update.settings
    for index in range(spec.warmup_steps):
        if index == spec.warmup_steps - 1:  # an update measures memory when it is logged
            trainer.update.settings = dataclasses.replace(never_logged, log_interval=1)
        timed_update(trainer, batches[index % len(batches)], clock)
        trainer.update.settings = never_logged
    if communicates:
        with communication_off(trainer):  # first allocations of the gathered parameters
            timed_update(trainer, batches[0], clock)

    sharing = HostSharing(spec.rendezvous_dir, spec.concurrent_processes)
    sharing.wait(f"{strategy}.warm")
    step, optimizer, compute_step, compute_optimizer = [], [], [], []
    for index in range(spec.steps):
        batch = batches[index % len(batches)]
        order = ("full", "off") if index % 2 == 0 else ("off", "full")
        for kind in order if communicates else ("full",):
            gc.collect()
            if kind == "full":
                seconds, in_optimizer = timed_update(trainer, batch, clock)
                step.append(seconds)
                optimizer.append(in_optimizer)
            else:
                with communication_off(trainer):
                    seconds, in_optimizer = timed_update(trainer, batch, clock)
                compute_step.append(seconds)
                compute_optimizer.append(in_optimizer)
        progress(f"{strategy}: update {index + 1}/{spec.steps} {step[-1]:.3f} s")
    sharing.wait(f"{strategy}.timed", keep_busy=lambda: trainer.train_step(batches[0]))

    alone = ctx.world_size == 1 and not sharing.shared
    plain, on_dtensors = time_optimizer_on_dtensors(trainer) if alone else ([], [])
    everyone = ctx.all_gather_object((step, optimizer, compute_step, compute_optimizer, trainer.last_memory))
    result = StrategyTimes(
        strategy=strategy,
        world_size=ctx.world_size,
        dp_degree=ctx.dims.dp,
        vocab_size=unwrap(trainer.model).config.vocab_size,
        step_s=_per_update(max, [rank[0] for rank in everyone]),
        optimizer_s=_per_update(statistics.fmean, [rank[1] for rank in everyone]),
        compute_step_s=_per_update(max, [rank[2] for rank in everyone]),
        compute_optimizer_s=_per_update(statistics.fmean, [rank[3] for rank in everyone]),
        memory=[rank[4] for rank in everyone],
        device=str(ctx.device),
        ranks_per_node=ctx.env.local_world_size,
        optimizer_plain_s=plain,
        optimizer_dtensor_s=on_dtensors,
    )
    del trainer, batches, loader
    gc.collect()
    ctx.barrier()
    return result


def time_optimizer_on_dtensors(trainer: Any, rounds: int = 9) -> tuple[list[float], list[float]]:
    """One rank: the update's optimizer part (gradient clipping, the optimizer step and
    the norm read on the host) over copies of the model's parameters and gradients, held
    as plain tensors and as DTensors on a one-rank mesh (as FSDP2 and tensor parallel hold
    them); seconds per round, the two interleaved after one untimed round each.

    Sharding over more ranks shrinks the bytes the step touches, not DTensor's dispatch
    for every tensor of every foreach call: the difference is the planner's per-tensor
    cost of a sharded optimizer step. Without a process group (a one-rank launch) a
    one-rank group of the backend's kind is made for the mesh and removed afterwards.
    torch-xla runs neither FSDP2 nor DTensor tensor parallel: nothing to time there."""
    if trainer.ctx.backend.dist_backend == "xla":
        return [], []
    own_group = not dist.is_initialized()
    if own_group:
        dist.init_process_group(trainer.ctx.backend.dist_backend, store=dist.HashStore(), rank=0, world_size=1)
    try:
        mesh = DeviceMesh(trainer.ctx.device.type, [dist.get_rank()])
        settings = AdamWSettings.from_config(trainer.config.optim)
        max_norm = trainer.config.optim.clip_norm or math.inf
        foreach = trainer.handle.foreach_clip
        source = list(unwrap(trainer.model).parameters())
        dtype = source[0].dtype

        def optimizer_part(on_dtensors: bool) -> Callable[[], None]:
            """The optimizer part over fresh copies of the parameters, as plain tensors or DTensors."""
            params = []
            for original in source:
                data, grad = original.detach().clone(), torch.full_like(original, 1e-3)
                if on_dtensors:
                    data, grad = (distribute_tensor(t, mesh, [Shard(0)]) for t in (data, grad))
                param = nn.Parameter(data)
                param.grad = grad
                params.append(param)
            optimizer = build_optimizer(params, settings, dtype)

            def call() -> None:
                norm = torch.nn.utils.clip_grad_norm_(params, max_norm, foreach=foreach)
                optimizer.step()
                float(norm.full_tensor() if hasattr(norm, "full_tensor") else norm)
                trainer.ctx.backend.synchronize()

            return call

        contenders = {"plain": optimizer_part(False), "dtensor": optimizer_part(True)}
        seconds = time_interleaved(contenders, rounds, gc.collect)
        return seconds["plain"], seconds["dtensor"]
    finally:
        if own_group:
            dist.destroy_process_group()


def _per_update(combine: Callable[[Sequence[float]], float], per_rank: list[list[float]]) -> list[float]:
    """``combine`` of the ranks' values of each update (the update's slowest rank, their mean)."""
    return [combine(values) for values in zip(*per_rank)]


def probe_collectives(
    sizes: list[int], ranks_per_node: int, device: torch.device, rounds: int = 7
) -> dict[str, Any]:
    """The collectives a data-parallel update runs, timed alone on fp32 buffers: the plain
    (averaging) all-reduce of DDP's buckets (method ``plain``, as ``benchmarks/allreduce.py``
    reports it), and FSDP2's two as it calls them, ``all_gather_into_tensor`` into an
    output of each size (``all_gather``) and an averaging ``reduce_scatter_tensor`` of an
    input of each size (``reduce_scatter``). Per collective and size, the median over
    ``rounds`` calls (after one warm-up, the three interleaved) of the slowest rank's time.
    ``distlm.plan --calibrate`` fits each collective's alpha and beta to these."""
    world = dist.get_world_size()
    reducer = comm_hooks.build_reducer("allreduce", None, device_type=device.type)
    rows = []
    for size in sizes:
        numel = max(world, size // 4 // world * world)
        full = torch.ones(numel, device=device)
        shard = torch.ones(numel // world, device=device)
        calls = {
            PROBE_METHODS["all_reduce"]: lambda: reducer(full).wait(),
            PROBE_METHODS["all_gather"]: lambda: dist.all_gather_into_tensor(full, shard),
            PROBE_METHODS["reduce_scatter"]: lambda: dist.reduce_scatter_tensor(shard, full, op=dist.ReduceOp.AVG),
        }
        seconds = time_interleaved(calls, rounds, dist.barrier)
        times = torch.tensor([seconds[method] for method in calls], dtype=torch.float64)
        dist.all_reduce(times, op=dist.ReduceOp.MAX)
        for method, slowest in zip(calls, times.tolist()):
            rows.append({"size_bytes": numel * 4, "method": method, "median_s": round(statistics.median(slowest), 7)})
    return {
        "benchmark": "allreduce",
        "world_size": world,
        "ranks_per_node": ranks_per_node,
        "torch": torch.__version__,
        "collectives": rows,
    }


def time_interleaved(
    calls: dict[str, Callable[[], object]], rounds: int, before_each: Callable[[], object]
) -> dict[str, list[float]]:
    """Seconds of each call per round, ``rounds`` rounds after an untimed one, the calls of
    a round in an order rotated every round, ``before_each`` (a barrier, a collection) run
    untimed before every call."""
    seconds: dict[str, list[float]] = {name: [] for name in calls}
    for index in range(rounds + 1):
        for name in rotated(list(calls), index):
            before_each()
            start = time.perf_counter()
            calls[name]()
            if index > 0:
                seconds[name].append(time.perf_counter() - start)
    return seconds


def rotated(items: list[Any], shift: int) -> list[Any]:
    """``items`` started ``shift`` places later, wrapping around."""
    shift %= len(items)
    return items[shift:] + items[:shift]


def peak_flops_per_rank(device: torch.device, precision: str) -> float | None:
    """Peak FLOP/s of one rank: on CPU a timed matmul with this process's threads (the
    planner's probe), elsewhere the device's table entry; None for a device without one."""
    try:
        if device.type == "cpu":
            return measure_cpu_matmul_flops(dtype_name(precision), threads=torch.get_num_threads())
        return device_peak_flops(device.type, precision)
    except UsageError:
        return None


def measure_launch(spec: LaunchSpec, progress: Callable[[str], None] = lambda line: None) -> dict[str, Any]:
    """Every strategy of the spec in order, then the collective probe (with more than one
    rank) and the peak FLOP/s of a rank; collective, the result is complete on rank 0."""
    results = [measure_strategy(spec, strategy, progress) for strategy in spec.strategies]
    device = torch.device(results[-1].device)
    distributed = dist.is_initialized() and dist.get_world_size() > 1
    allreduce = None
    if distributed and spec.allreduce_sizes:
        progress(f"collective probe (all-reduce, all-gather, reduce-scatter): {len(spec.allreduce_sizes)} sizes")
        allreduce = probe_collectives(spec.allreduce_sizes, results[-1].ranks_per_node, device)
    peak = None
    # The peak is one rank's alone: concurrent one-rank launches would time it beside each other.
    if not HostSharing(spec.rendezvous_dir, spec.concurrent_processes).shared and (
            not distributed or dist.get_rank() == 0):
        peak = peak_flops_per_rank(device, spec.precision)
    if distributed:
        dist.barrier()  # the other ranks wait while rank 0 times its matmul alone
    return {"strategies": [asdict(result) for result in results], "allreduce": allreduce,
            "peak_flops_per_rank": peak, "threads_per_rank": torch.get_num_threads(), "host_cores": host_cores(),
            "device": device.type, "torch": torch.__version__}
