"""The run's layout, described once: how the ranks split the model and the data, and how they talk.

``Layout`` holds the parallel degrees, the data-parallel strategy and its settings (buckets,
the gradient communication hook and its transport, double buffering), the simulated nodes,
and the pipeline (``PipelineLayout``), each with its default; and the rules that resolve a
setting from others (micro-batches from the pipeline degree, nodes from ranks per node).
The command line (``DistributedConfig``), ``parallelize``, the planner's ``Workload`` and
the scaling suite's ``LaunchSpec`` all take their defaults and rules from here, so they
cannot drift apart. Nothing here imports torch: the command line parses before anything
heavy loads.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Mapping

from distlm.choices import COMM_HOOK_KINDS, PP_LOOPED_SCHEDULES, PP_ZERO_BUBBLE_SCHEDULES, CommHook
from distlm.errors import UsageError

PIPELINE_PREFIX = "pp_"
"""The command line names the pipeline's settings with this prefix (``schedule`` is ``--pp-schedule``)."""


@dataclass(frozen=True)
class PipelineLayout:
    """How pipeline parallel runs its stages (used when the pipeline degree is above 1)."""

    schedule: str = "1f1b"
    """gpipe, 1f1b, or a looped schedule (interleaved-1f1b, zero-bubble, zbv) running several stages per rank."""
    microbatches: int = 0
    """Micro-batches each batch is split into per pipeline pass; 0: twice the pipeline degree."""
    stages_per_rank: int = 1
    """Stages each rank runs: 1, or 2 and more for the looped schedules (exactly 2 for zbv)."""
    split: str | None = None
    """Blocks of each stage, e.g. ``0:12,12:24``; None: balanced by parameter count."""

    @property
    def looped(self) -> bool:
        """Whether the schedule runs several stages on each rank."""
        return self.schedule in PP_LOOPED_SCHEDULES

    @property
    def splits_backward(self) -> bool:
        """Whether the schedule splits backward into its input and weight parts (zero bubble)."""
        return self.schedule in PP_ZERO_BUBBLE_SCHEDULES

    def microbatch_count(self, degree: int) -> int:
        """Micro-batches of one pipeline pass at pipeline degree ``degree``."""
        return self.microbatches or 2 * degree

    def stage_count(self, degree: int) -> int:
        """Stages of the whole pipeline: each of the ``degree`` ranks runs ``stages_per_rank``."""
        return degree * self.stages_per_rank

    def check_stages_per_rank(self) -> None:
        """UsageError unless the schedule runs this many stages per rank (distlm.train and the
        planner refuse alike): one for gpipe and 1f1b, two or more looped, exactly two for zbv."""
        per_rank, schedule = self.stages_per_rank, self.schedule
        if schedule == "zbv" and per_rank != 2:
            raise UsageError(f"--pp-schedule zbv runs exactly 2 stages per rank; set --pp-stages-per-rank 2 "
                             f"(got {per_rank})")
        if self.looped and per_rank < 2:
            raise UsageError(f"--pp-schedule {schedule} runs several stages per rank; "
                             "set --pp-stages-per-rank 2 or more, or use --pp-schedule 1f1b")
        if not self.looped and per_rank != 1:
            raise UsageError(f"--pp-stages-per-rank {per_rank} needs a looped schedule "
                             f"({', '.join(PP_LOOPED_SCHEDULES)}); --pp-schedule {schedule} runs one stage per rank")

    def check_microbatches(self, degree: int, batch_size: int) -> None:
        """UsageError unless a ``batch_size`` batch splits into this pipeline's micro-batches at
        pipeline degree ``degree`` (distlm.train and the planner refuse alike)."""
        count, schedule = self.microbatch_count(degree), self.schedule
        if count < degree:
            raise UsageError(f"--pp-microbatches {count} is below --pp-degree {degree}; "
                             "use at least as many micro-batches as stages, or the pipeline never fills")
        if batch_size % count:
            raise UsageError(f"--batch-size {batch_size} does not split into --pp-microbatches {count}; "
                             "make the batch size a multiple of the micro-batches")
        if self.looped and count % degree:
            raise UsageError(f"--pp-schedule {schedule} wants --pp-microbatches a multiple of --pp-degree {degree}, "
                             f"got {count}")


@dataclass(frozen=True)
class Layout:
    """The run's layout: degrees, data-parallel strategy and communication, nodes, pipeline.

    Field names are ``DistributedConfig``'s (the pipeline's with its ``pp_`` prefix), whose
    fields take their defaults from here."""

    dp_degree: int = -1
    """Data-parallel ranks; -1: whatever the tensor- and pipeline-parallel degrees leave of the world."""
    tp_degree: int = 1
    """Ranks that split each layer (tensor parallel); they see the same batch."""
    pp_degree: int = 1
    """Pipeline stages (ranks that each hold a run of blocks)."""
    ep_degree: int = 1
    """Data-parallel ranks that split each MoE layer's experts between them (expert parallel)."""
    strategy: str = "ddp"
    """How the data-parallel ranks hold the model: ddp, zero1 or fsdp."""
    sequence_parallel: bool = False
    """With tensor parallel: also shard norms and dropout regions along the sequence."""
    activation_checkpointing: bool = False
    """Recompute each block's activations in backward instead of storing them."""
    cpu_offload: bool = False
    """FSDP: keep parameters and optimizer state in host memory."""
    bucket_cap_mb: float = 25.0
    """DDP's gradient bucket size in MiB (also ZeRO-1's parameter sync buckets)."""
    comm_hook: str = "allreduce"
    """How each DDP gradient bucket is averaged (``choices.COMM_HOOK_KINDS``)."""
    comm_transport: str = "torch"
    """What carries the hook's all-reduce: torch (the process group) or mpi (mpi4py)."""
    double_buffering: bool = False
    """ChainerMN double buffering: update t applies update t-1's averaged gradients."""
    ranks_per_node: int | None = None
    """Hierarchical hook: simulated nodes of this many consecutive ranks; None: the real nodes."""
    pipeline: PipelineLayout = field(default_factory=PipelineLayout)
    """The pipeline's schedule, micro-batches, stages per rank and split."""

    @classmethod
    def from_config(cls, settings: Any) -> Layout:
        """The layout of a ``DistributedConfig`` (any object with its field names)."""
        return cls.from_settings({name: getattr(settings, name) for name in setting_names() if hasattr(settings, name)})

    @classmethod
    def from_settings(cls, values: Mapping[str, Any]) -> Layout:
        """The layout of flat settings named as the command line names them (``tp_degree``,
        ``pp_schedule``...); a missing one takes its default, other keys are ignored."""
        own = {f.name: values[f.name] for f in dataclasses.fields(cls) if f.name != "pipeline" and f.name in values}
        pipeline = {f.name: values[PIPELINE_PREFIX + f.name] for f in dataclasses.fields(PipelineLayout)
                    if PIPELINE_PREFIX + f.name in values}
        return cls(**own, pipeline=PipelineLayout(**pipeline))

    def settings(self) -> dict[str, Any]:
        """The layout as flat settings named as the command line names them (``from_settings``'s input)."""
        flat = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name != "pipeline"}
        return {**flat, **{PIPELINE_PREFIX + name: value for name, value in dataclasses.asdict(self.pipeline).items()}}

    @property
    def hook(self) -> CommHook:
        """The kind of the gradient communication hook: flat or hierarchical, and its wire dtype."""
        return COMM_HOOK_KINDS[self.comm_hook]

    @property
    def hooks_asked(self) -> bool:
        """Whether anything but DDP's own all-reduce over the process group is asked for: a
        communication hook, its MPI transport or double buffering (all DDP-only)."""
        return (self.comm_hook != Layout.comm_hook or self.comm_transport != Layout.comm_transport
                or self.double_buffering)


def setting_names() -> list[str]:
    """Every setting of the layout, as the command line names it (``Layout.settings``'s keys)."""
    return list(Layout().settings())


def simulated_node_of_rank(ranks_per_node: int | None, world_size: int) -> tuple[int, ...]:
    """The node of each of ``world_size`` ranks on simulated nodes of ``ranks_per_node``
    consecutive ranks; UsageError naming --ranks-per-node unless it divides the world."""
    if ranks_per_node is None:
        raise UsageError("--comm-hook hierarchical needs --ranks-per-node (the number of ranks on each node)")
    if ranks_per_node < 1 or world_size % ranks_per_node:
        raise UsageError(
            f"--ranks-per-node {ranks_per_node} does not divide the world size {world_size}; "
            "give the number of ranks on each node (every node must run as many)"
        )
    return tuple(rank // ranks_per_node for rank in range(world_size))
