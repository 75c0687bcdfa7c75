"""A model of one training update: step time, tokens/s, scaling efficiency, memory per rank.

* Compute: FLOPs per token (``flops.py``) over the rank's achieved FLOP/s (peak x an
  assumed fraction, or a calibrated number); backward costs twice the forward.
* Communication: each collective from an alpha-beta model, latency plus bytes over
  bandwidth, on the link it crosses: the intra-node link per rank (NVLink/NVSwitch,
  NeuronLink) or the node's network (EFA), which the node's concurrent groups share.
  All-gather and reduce-scatter have their own costs: ring formulas on the link, or
  their own measured alpha and beta (``--calibrate`` with a collective probe); a backend
  without a reduce-scatter of its own (gloo) runs it as an all-reduce of the whole input.
* Overlap, as each strategy really allows it:
  - DDP (and ZeRO-1's gradient all-reduce): gradient buckets are all-reduced one after
    another as backward fills them, so all but what remains after the last bucket is
    ready hides behind the rest of backward (simulated bucket by bucket);
  - ChainerMN double buffering: the all-reduce of update t has until update t+1's
    optimizer step, a whole step of compute, to finish;
  - FSDP: each block's all-gather is prefetched during the previous block's compute,
    reduce-scatters run behind the next blocks' backward; the first all-gathers and the
    last reduce-scatter are exposed (simulated block by block); FSDP's copies into and
    out of the collective buffers run on the rank's compute engine at its memory bandwidth;
  - ZeRO-1's parameter sync after the optimizer step and tensor-parallel activation
    all-reduces sit on the critical path.
* CPU ranks (the ``local`` profile): collectives run on the host's cores, so when every
  core computes (ranks x threads >= cores) nothing overlaps: each collective adds its
  whole time. More ranks x threads than cores share them: compute, optimizer and copies
  slow down by ranks x threads / cores, or as measured with that many one-rank updates at
  once on the host (``--calibrate`` with the suite's host-sharing rows: shared caches and
  memory bandwidth count too). A collective issued while its rank still computes
  (FSDP's prefetched all-gathers, its reduce-scatters behind the next block's backward,
  DDP's buckets filled before backward ends) shares the cores with that compute: it runs
  slower than the probe that timed it alone, by the ratio of runnable threads to cores
  in the two cases (``collective_slowdown``).
* Memory: weights, gradients and Adam's two fp32 moments (``training.memory.zero_formula_bytes``:
  16 bytes a parameter in the precisions planned, whose autocast keeps fp32 weights), sharded
  as the strategy shards them, split by the tensor-parallel degree where the model's TP plan
  splits them; plus an estimate of activations.
* Pipeline parallel (``--pp-degree``, mesh order pp, dp, tp): each stage is projected on
  its own (its blocks, the embedding on the first, the head on the last, its data-parallel
  group and optimizer), one pipeline micro-batch at a time. A pass of M micro-batches
  takes M slots of the slowest stage plus the schedule's bubble of idle slots (P-1 for
  GPipe and 1F1B, so the bubble is (P-1)/(M+P-1) of the pass; divided by V when each rank
  runs V interleaved stages); a slot is that stage's forward and backward plus the two
  point-to-point transfers it waits for (the activation in, its gradient back). The
  zero-bubble schedules' passes are played out action by action in torch's own order, their
  backward split into input- and weight-gradient passes that cost more than one backward
  (``SPLIT_BACKWARD_COST``; distlm/plan/schedule.py). Memory per
  rank counts only its stage, with the activations of the micro-batches it holds in flight.
* Mixture of experts: compute counts the parameters a token multiplies (its top-k experts,
  ``flops.active_matmul_parameters``). Expert parallel (``--ep-degree``, groups of
  consecutive data-parallel ranks) holds ``1/ep`` of each MoE layer's experts whole on each
  rank, outside the dense strategy (weights, gradients and moments unsharded), updated where they live, their
  gradients all-reduced over the ranks holding the same experts once backward is done (on
  the critical path). Each MoE layer's all-to-alls (tokens to their experts and back, in
  forward and backward) and its routing statistics' all-reduce run inside the block, on the
  critical path as tensor parallel's are; routing is assumed even, so ``(ep-1)/ep`` of a
  rank's top-k token copies leave it.
"""

from __future__ import annotations

import dataclasses
import math
import tomllib
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any

from distlm.backends.hardware import device_key, host_cores, measure_cpu_matmul_flops, peak_flops
from distlm.choices import COLLECTIVES, PROFILE_DEVICE_TYPES
from distlm.config import DataConfig, check_shared_settings
from distlm.errors import UsageError
from distlm.layout import Layout, PipelineLayout
from distlm.models import registry
from distlm.models.flops import ModelShape, count_parameter_tensors, flops_per_token, local_parameters
from distlm.models.sizes import LocalParameters
from distlm.plan.schedule import ActionTimes, pass_seconds, zero_bubble_orders
from distlm.precision import DTYPES, MODE_DTYPES, dtype_name
from distlm.training.memory import ZERO_STAGES, zero_formula_bytes

GIB = 1024**3
MIB = 1024**2
ALLREDUCE_ALGORITHMS = ("ring", "tree", "auto")
# torch DDP puts the first gradients of backward in a small bucket of its own
# (torch.distributed's _DEFAULT_FIRST_BUCKET_BYTES), so communication starts early.
DDP_FIRST_BUCKET_BYTES = 1 * MIB
# Bytes an fp32 AdamW step moves per parameter: read weight, gradient and both moments
# (16), write weight and moments (12), plus gradient clipping's norm read and in-place
# scale of the gradient (12). The step is memory-bound, so time = bytes / memory bandwidth.
ADAM_BYTES_PER_PARAM = 40
# Korthikanti et al. 2022 ("Reducing Activation Recomputation in Large Transformer
# Models"), bytes a block keeps for backward per token and hidden unit with 16-bit
# activations: 34 without tensor parallel, 10 + 24/t with it, 34/t with sequence
# parallel. The attention-score term (5 a s / h) is left out: SDPA's fused kernels do not
# keep the scores.
ACTIVATION_BYTES_PER_TOKEN_UNIT = 34.0
# Of those 34, the feed-forward's (its input, two 4h-wide intermediates and a dropout mask).
DENSE_MLP_BYTES_PER_TOKEN_UNIT = 19.0
PROFILES_PACKAGE = "distlm.plan"
# torch's zero-bubble schedules run a stage's backward as two autograd passes, the input
# gradients, then the weight gradients from the kept graph; together they cost more than one
# fused backward: about 1.1x at 768 wide and 1.3x or more at 192 wide (one 2-block Llama chunk
# of a 2x64-token micro-batch, fp32, one CPU thread), each operation being run and dispatched twice.
SPLIT_BACKWARD_COST = 1.3


# --------------------------------------------------------------------------- cluster


@dataclass(frozen=True)
class Link:
    """An alpha-beta link: a message of n bytes takes ``latency_s + n / bandwidth_Bps``."""

    latency_s: float
    bandwidth_Bps: float

    def transfer_s(self, nbytes: float) -> float:
        return self.latency_s + nbytes / self.bandwidth_Bps


@dataclass(frozen=True)
class Cluster:
    """A node type and its network, from a profile in ``distlm/plan/profiles``."""

    name: str
    device_type: str
    device: str
    ranks_per_node: int
    memory_bytes_per_rank: float
    memory_bandwidth_Bps: float
    """Per rank; sets the (memory-bound) optimizer step's time."""
    intra: Link
    """Collective bus bandwidth of one rank inside a node, and the per-step latency."""
    inter: Link
    """The node's network: bandwidth of the whole node (shared by its ranks), per-step latency."""
    achieved_fraction: dict[str, float]
    """Assumed fraction of peak FLOP/s that training achieves (an MFU guess), per precision."""
    achieved_flops: dict[str, float] = field(default_factory=dict)
    """Measured achieved FLOP/s per rank (calibration); wins over peak x fraction."""
    cpu_threads_per_rank: int | None = None
    """For ``cpu``: threads each rank uses, which the matmul probe measures with."""
    cores_per_node: int | None = None
    """For ``cpu``: the cores a node's ranks share (compute and collectives alike)."""
    single_host: bool = False
    """Every rank runs on this one host, simulated nodes included (``local``)."""
    reduce_scatter_via_allreduce: bool = False
    """The backend has no reduce-scatter of its own and all-reduces the whole input (gloo)."""
    measured_collectives: dict[tuple[str, int, int], tuple[float, float]] = field(default_factory=dict)
    """``(collective, ranks, ranks per node) -> (alpha, beta)``: measured ``alpha + bytes x beta``
    of one group alone (calibration); wins over the link's formulas for a group of that shape."""
    measured_host_sharing: dict[int, tuple[float, float]] = field(default_factory=dict)
    """For ``cpu``: ``ranks on a host -> (compute, optimizer)`` slowdowns measured with that many
    one-rank updates at once (calibration); win over ranks x threads / cores."""
    dtensor_step_per_tensor_s: float = 0.0
    """Seconds per parameter tensor that clipping and the optimizer step take on DTensors
    (FSDP, tensor parallel) beyond plain tensors: DTensor's dispatch, measured on one
    rank (calibration); 0 otherwise."""

    def peak_flops_per_rank(self, precision: str) -> float:
        if self.device_type == "cpu":
            return measure_cpu_matmul_flops(precision, threads=self.cpu_threads_per_rank)
        return peak_flops(self.device_type, precision, self.device)

    def achieved_flops_per_rank(self, precision: str) -> float:
        if precision in self.achieved_flops:
            return self.achieved_flops[precision]
        peak = self.peak_flops_per_rank(precision)  # refuses a precision the device lacks
        if precision not in self.achieved_fraction:
            raise UsageError(
                f"--cluster {self.name} states no achieved fraction for {precision}; "
                f"choose --precision {' or '.join(self.achieved_fraction)}, or calibrate with --calibrate"
            )
        return peak * self.achieved_fraction[precision]


def available_clusters() -> list[str]:
    """Names of the bundled cluster profiles."""
    folder = resources.files(PROFILES_PACKAGE) / "profiles"
    return sorted(entry.name[: -len(".toml")] for entry in folder.iterdir() if entry.name.endswith(".toml"))


def load_cluster(name: str, ranks_per_node: int | None = None) -> Cluster:
    """The bundled profile ``name`` (e.g. ``p4d.24xlarge``), or a profile TOML file by path.

    ``ranks_per_node`` overrides the profile's (for ``local``: how many ranks share this
    machine's cores).
    """
    if name.endswith(".toml") or "/" in name:
        path = Path(name)
        try:
            text = path.read_text()
        except OSError as exc:
            raise UsageError(f"--cluster {name}: cannot read the profile ({exc.strerror or exc})") from None
        source = str(path)
    else:
        entry = resources.files(PROFILES_PACKAGE) / "profiles" / f"{name}.toml"
        if not entry.is_file():
            raise UsageError(
                f"--cluster {name} is unknown; choose one of {', '.join(available_clusters())} or a .toml file"
            )
        text, source = entry.read_text(), f"profile {name}"
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise UsageError(f"--cluster {source}: not valid TOML ({exc})") from None
    return _cluster_from_table(data, source, ranks_per_node)


def _cluster_from_table(data: dict[str, Any], source: str, ranks_per_node: int | None) -> Cluster:
    def number(table: dict[str, Any], key: str, where: str) -> float:
        value = table.get(key)
        if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
            raise UsageError(f"--cluster {source}: {where}{key} must be a positive number, got {value!r}")
        return float(value)

    def section(key: str) -> dict[str, Any]:
        value = data.get(key)
        if not isinstance(value, dict):
            raise UsageError(f"--cluster {source}: missing the [{key}] table")
        return value

    device_type = data.get("device_type")
    if device_type not in PROFILE_DEVICE_TYPES:
        raise UsageError(f"--cluster {source}: device_type must be one of {', '.join(PROFILE_DEVICE_TYPES)}, "
                         f"got {device_type!r}")
    device = str(data.get("device", "cpu"))
    if device_type != "cpu":
        device_key(device_type, device)  # refuses a device with no peak FLOP/s table
    intra, inter = section("intra_node"), section("inter_node")
    fractions = section("achieved_fraction")
    achieved_fraction = {}
    for precision, value in fractions.items():
        number_in_range = isinstance(value, (int, float)) and not isinstance(value, bool) and 0 < value <= 1
        if precision not in DTYPES or not number_in_range:
            raise UsageError(
                f"--cluster {source}: achieved_fraction.{precision} must name one of {', '.join(DTYPES)} "
                "and be a fraction in (0, 1]"
            )
        achieved_fraction[precision] = float(value)
    profile_ranks = int(number(data, "ranks_per_node", ""))
    if ranks_per_node is not None and ranks_per_node < 1:
        raise UsageError(f"--ranks-per-node must be at least 1, got {ranks_per_node}")
    rpn = ranks_per_node or profile_ranks
    inter_efficiency = number(inter, "efficiency", "inter_node.")
    if inter_efficiency > 1:
        raise UsageError(f"--cluster {source}: inter_node.efficiency is a fraction of the nominal rate, at most 1")
    flags = {}
    for key in ("single_host", "reduce_scatter_via_allreduce"):
        value = data.get(key, False)
        if not isinstance(value, bool):
            raise UsageError(f"--cluster {source}: {key} must be true or false, got {value!r}")
        flags[key] = value
    # Ranks of this machine share its cores, so the CPU probe measures one rank's share.
    cores = host_cores() if device_type == "cpu" else None
    threads = max(1, cores // rpn) if cores is not None else None
    return Cluster(
        name=str(data.get("name", source)),
        device_type=device_type,
        device=device,
        ranks_per_node=rpn,
        memory_bytes_per_rank=number(data, "memory_gib_per_rank", "") * GIB,
        memory_bandwidth_Bps=number(data, "memory_bandwidth_GBps_per_rank", "") * 1e9,
        intra=Link(
            number(intra, "latency_us", "intra_node.") * 1e-6, number(intra, "bandwidth_GBps", "intra_node.") * 1e9
        ),
        inter=Link(
            number(inter, "latency_us", "inter_node.") * 1e-6,
            number(inter, "nominal_Gbps", "inter_node.") * 1e9 / 8 * inter_efficiency,
        ),
        achieved_fraction=achieved_fraction,
        cpu_threads_per_rank=threads,
        cores_per_node=cores,
        **flags,
    )


# --------------------------------------------------------------------- collectives


def ring_allreduce_time(nbytes: float, ranks: int, link: Link) -> float:
    """Ring all-reduce (reduce-scatter then all-gather, 2(p-1) steps of n/p bytes each):
    ``2 (p-1) alpha + 2 (p-1)/p x n / bandwidth``."""
    if ranks <= 1 or nbytes <= 0:
        return 0.0
    return 2 * (ranks - 1) * link.latency_s + 2 * (ranks - 1) / ranks * nbytes / link.bandwidth_Bps


def tree_allreduce_time(nbytes: float, ranks: int, link: Link) -> float:
    """Pipelined (double binary) tree all-reduce: a reduce up and a broadcast down the
    tree, ``2 ceil(log2 p) alpha + 2 n / bandwidth``; fewer latency steps than a ring, the
    same bandwidth term for large p."""
    if ranks <= 1 or nbytes <= 0:
        return 0.0
    return 2 * math.ceil(math.log2(ranks)) * link.latency_s + 2 * nbytes / link.bandwidth_Bps


def reduce_scatter_time(nbytes: float, ranks: int, link: Link) -> float:
    """Ring reduce-scatter of an n-byte buffer: ``(p-1) alpha + (p-1)/p x n / bandwidth``."""
    if ranks <= 1 or nbytes <= 0:
        return 0.0
    return (ranks - 1) * link.latency_s + (ranks - 1) / ranks * nbytes / link.bandwidth_Bps


def all_gather_time(nbytes: float, ranks: int, link: Link) -> float:
    """Ring all-gather into an n-byte buffer; the same cost as a reduce-scatter of n bytes."""
    return reduce_scatter_time(nbytes, ranks, link)


@dataclass(frozen=True)
class Group:
    """A process group laid over the cluster: ``ranks`` in all, spread over ``nodes``,
    with ``concurrent`` such groups communicating at once through each node's network."""

    ranks: int
    nodes: int
    concurrent: int = 1


def group_link(group: Group, cluster: Cluster) -> Link:
    """The link a ring over ``group`` runs at: the intra-node link inside one node; across
    nodes, every step waits for a network hop, and each node's network carries every
    concurrent group's ring (its bandwidth is shared), never faster than the intra link."""
    if group.nodes <= 1:
        return cluster.intra
    bandwidth = min(cluster.intra.bandwidth_Bps, cluster.inter.bandwidth_Bps / group.concurrent)
    return Link(max(cluster.inter.latency_s, cluster.intra.latency_s), bandwidth)


def flat_allreduce_time(nbytes: float, group: Group, cluster: Cluster, algorithm: str = "ring") -> float:
    """All-reduce over ``group`` with ``algorithm`` (ring, tree, or auto: the faster, as NCCL picks)."""
    link = group_link(group, cluster)
    ring = ring_allreduce_time(nbytes, group.ranks, link)
    if algorithm == "ring":
        return ring
    tree = tree_allreduce_time(nbytes, group.ranks, link)
    return tree if algorithm == "tree" else min(ring, tree)


def measured_collective(kind: str, group: Group, cluster: Cluster) -> tuple[float, float] | None:
    """The calibrated ``(alpha, beta)`` of ``kind`` over a group of ``group``'s shape, if one
    was measured: a group alone (a probe times one group, not several sharing a network)."""
    if group.concurrent != 1:
        return None
    per_node = group.ranks if cluster.single_host else math.ceil(group.ranks / group.nodes)
    return cluster.measured_collectives.get((kind, group.ranks, per_node))


def collective_time(kind: str, nbytes: float, group: Group, cluster: Cluster, algorithm: str = "ring") -> float:
    """One ``kind`` collective (``all_reduce``, ``all_gather``, ``reduce_scatter``) over
    ``group``; ``nbytes`` is the all-reduced buffer, the all-gathered output or the
    reduce-scattered input. A measured alpha-beta of a group of this shape wins; otherwise
    the ring formula on the group's link (``algorithm`` for all-reduce). A backend without
    a reduce-scatter of its own (``reduce_scatter_via_allreduce``) pays an all-reduce of
    the whole input."""
    if kind not in COLLECTIVES:
        raise ValueError(f"unknown collective {kind!r}")
    if group.ranks <= 1 or nbytes <= 0:
        return 0.0
    measured = measured_collective(kind, group, cluster)
    if measured is None and kind == "reduce_scatter" and cluster.reduce_scatter_via_allreduce:
        kind = "all_reduce"
        measured = measured_collective(kind, group, cluster)
    if measured is not None:
        alpha, beta = measured
        return alpha + beta * nbytes
    if kind == "all_reduce":
        return flat_allreduce_time(nbytes, group, cluster, algorithm)
    ring = all_gather_time if kind == "all_gather" else reduce_scatter_time
    return ring(nbytes, group.ranks, group_link(group, cluster))


def hierarchical_allreduce_time(
    nbytes: float, nodes: int, ranks_per_node: int, cluster: Cluster, inter_bytes_factor: float = 1.0,
    algorithm: str = "ring",
) -> float:
    """distlm's hierarchical all-reduce: reduce-scatter inside each node, all-reduce of the
    node's 1/k shard across nodes among ranks of the same local rank (k such rings share
    the node's network), all-gather inside the node. ``inter_bytes_factor`` 0.5 is the
    fp16 inter-node leg of ``hierarchical-fp16``."""
    if nodes * ranks_per_node <= 1:
        return 0.0
    node = Group(ranks=ranks_per_node, nodes=1)
    intra = collective_time("reduce_scatter", nbytes, node, cluster)
    intra += collective_time("all_gather", nbytes, node, cluster)
    inter_group = Group(ranks=nodes, nodes=nodes, concurrent=ranks_per_node)
    inter = collective_time("all_reduce", nbytes / ranks_per_node * inter_bytes_factor, inter_group, cluster, algorithm)
    return intra + inter


def host_ranks(layout: Placement, cluster: Cluster) -> int:
    """Ranks sharing one host's cores: a node's, or every rank on a single host."""
    return layout.world if cluster.single_host else layout.ranks_per_node


def cpu_busy_threads(layout: Placement, cluster: Cluster) -> int | None:
    """Compute threads on one CPU host (ranks x threads per rank); None off CPU."""
    if cluster.device_type != "cpu" or not cluster.cores_per_node:
        return None
    return host_ranks(layout, cluster) * (cluster.cpu_threads_per_rank or 1)


def compute_slowdown(layout: Placement, cluster: Cluster) -> float:
    """How much slower each rank computes because its host's cores are shared: as measured
    with that many one-rank updates at once, else ranks x threads over cores when they
    exceed them (the scheduler time-slices), else 1."""
    busy = cpu_busy_threads(layout, cluster)
    if busy is None:
        return 1.0
    measured = measured_host_sharing(layout, cluster)
    return measured[0] if measured else max(1.0, busy / cluster.cores_per_node)


def memory_slowdown(layout: Placement, cluster: Cluster) -> float:
    """The same for the memory-bound work (optimizer step, FSDP's copies): as measured for
    the optimizer step, else ``compute_slowdown``."""
    measured = measured_host_sharing(layout, cluster)
    return measured[1] if measured else compute_slowdown(layout, cluster)


def measured_host_sharing(layout: Placement, cluster: Cluster) -> tuple[float, float] | None:
    """``(compute, optimizer)`` slowdowns calibrated for this many ranks on a CPU host; None without."""
    if cpu_busy_threads(layout, cluster) is None:
        return None
    return cluster.measured_host_sharing.get(host_ranks(layout, cluster))


def collective_slowdown(layout: Placement, cluster: Cluster) -> float:
    """How much longer a CPU collective takes beside its rank's compute than alone.

    Alone (the collective probe), each rank's communication thread is the only one
    runnable: ranks threads on the host's cores. Beside compute, each rank also runs its
    compute threads: ranks x (threads + 1). Fair time-slicing gives each thread the cores
    over the runnable threads, so the collective slows by the ratio of the two
    over-subscriptions (2 for one-thread ranks on as many cores as ranks, or twice as
    many ranks). 1 off CPU: accelerators communicate on engines of their own."""
    busy = cpu_busy_threads(layout, cluster)
    if busy is None:
        return 1.0
    ranks = host_ranks(layout, cluster)
    beside = max(1.0, (busy + ranks) / cluster.cores_per_node)
    alone = max(1.0, ranks / cluster.cores_per_node)
    return beside / alone


def communication_overlaps(layout: Placement, cluster: Cluster) -> bool:
    """Whether collectives can run beside compute. Accelerators have engines of their own
    for them; CPU ranks need a core, and when every core computes (ranks x threads >=
    cores) each collective's time adds to the step."""
    busy = cpu_busy_threads(layout, cluster)
    return busy is None or busy < cluster.cores_per_node


# ----------------------------------------------------------------------- workload


@dataclass(frozen=True)
class Placement:
    """Where the ranks are: ``nodes`` x ``ranks_per_node``, split by the degrees of ``layout``:
    tensor parallel inside a node, pipeline stages outermost (each a block of world / pp
    consecutive ranks), expert parallel over groups of consecutive data-parallel ranks (as
    distlm's ``ParallelDims`` lays them out)."""

    nodes: int
    ranks_per_node: int
    layout: Layout = field(default_factory=Layout)
    """The run's layout; its tensor-, pipeline- and expert-parallel degrees place the ranks."""

    @property
    def tp(self) -> int:
        return self.layout.tp_degree

    @property
    def pp(self) -> int:
        return self.layout.pp_degree

    @property
    def ep(self) -> int:
        return self.layout.ep_degree

    def one_replica(self) -> Placement:
        """One model replica alone: its tensor- and pipeline-parallel ranks on one node, no expert parallel."""
        return Placement(1, self.tp * self.pp, dataclasses.replace(self.layout, ep_degree=Layout.ep_degree))

    @property
    def world(self) -> int:
        return self.nodes * self.ranks_per_node

    @property
    def dp(self) -> int:
        return self.world // (self.tp * self.pp)

    @property
    def stage_nodes(self) -> int:
        """Nodes one pipeline stage spans (all of them without pipeline parallel)."""
        return max(1, math.ceil(self.nodes / self.pp))

    def dp_group(self) -> Group:
        # Tensor-parallel ranks are neighbours in a node, so each data-parallel group holds
        # ranks_per_node / tp ranks of every node of its stage, and tp such groups share each node's network.
        return Group(ranks=self.dp, nodes=self.stage_nodes, concurrent=self.tp)

    def ep_group(self) -> Group:
        """An expert-parallel group: ``ep`` consecutive ranks, inside a node when they fit;
        spread over nodes, all of a node's ranks send across its network at once."""
        nodes = max(1, math.ceil(self.ep / self.ranks_per_node))
        return Group(ranks=self.ep, nodes=nodes, concurrent=self.ranks_per_node if nodes > 1 else 1)

    def expert_replica_group(self) -> Group:
        """The ranks holding the same experts (one per expert-parallel group), whose expert
        gradients are summed: every ``ep``-th rank, so over all nodes, as many such groups
        sharing each node's network as a node holds ranks of one expert-parallel group."""
        ranks = self.dp // self.ep
        nodes = min(self.nodes, ranks)
        return Group(ranks=ranks, nodes=nodes, concurrent=min(self.ep, self.ranks_per_node) if nodes > 1 else 1)


@dataclass(frozen=True)
class Stage:
    """One pipeline stage: its share of the blocks, and whether it holds the embedding
    (``first``) and the final norm and output head (``last``)."""

    index: int
    blocks: int
    first: bool
    last: bool


@dataclass(frozen=True)
class Workload:
    """What one update runs: the model, the run's layout, precision and batch (distlm.train's meanings)."""

    shape: ModelShape
    layout: Layout = field(default_factory=Layout)
    """Strategy, communication hook and buckets, sequence parallel, activation checkpointing and
    pipeline; its degrees are the placement's (``project`` checks they agree)."""
    precision: str = "fp32"
    tokens_per_sample: int = 128
    batch_size: int = 16
    """Samples per micro-batch per data-parallel replica."""
    update_freq: int = 1
    allreduce_algorithm: str = "ring"
    mask_prob: float = DataConfig.mask_prob
    """distlm.train's --mask-prob: a masked LM's output runs at that share of the positions only."""
    stage: Stage | None = None
    """The pipeline stage a rank runs (set by ``project_pipeline``); None: the whole model."""

    @property
    def output_fraction(self) -> float:
        """The share of positions the model computes its output (logits, a masked LM's head) at."""
        return registry.family(self.shape.family).task.output_fraction(self.mask_prob)

    @property
    def tokens_per_micro_batch(self) -> int:
        return self.batch_size * self.tokens_per_sample

    @property
    def activation_bytes(self) -> int:
        """Bytes of an activation (and of a parameter FSDP gathers): the compute type's."""
        return MODE_DTYPES[self.precision].compute_bytes


@dataclass
class Projection:
    """One projected row: a layout's step time, throughput, efficiency and memory."""

    nodes: int
    ranks: int
    ranks_per_node: int
    dp_degree: int
    tp_degree: int
    global_batch_size: int
    update_freq: int
    step_time_s: float
    tokens_per_s: float
    samples_per_s: float
    efficiency: float
    mfu: float
    compute_slowdown: float
    """Compute, optimizer and copies run this much slower because ranks share a host's cores."""
    compute_s: float
    tp_comm_s: float
    dp_comm_s: float
    """Data-parallel collectives, one after another, hidden or not."""
    fsdp_copy_s: float
    """FSDP's copies into and out of its collective buffers (on the compute engine)."""
    comm_exposed_s: float
    """What the update waits for beyond compute and optimizer: collectives not hidden, and FSDP's copies."""
    optimizer_s: float
    param_bytes: float
    grad_bytes: float
    optimizer_bytes: float
    memory_bytes_per_rank: float
    activation_bytes_per_rank: float
    device_memory_bytes: float
    fits: bool
    pp_degree: int = Layout.pp_degree
    pp_schedule: str | None = None
    pp_microbatches: int = 1
    pp_stages_per_rank: int = PipelineLayout.stages_per_rank
    pp_bubble_s: float = 0.0
    """Idle pipeline slots of the update (its passes' bubbles)."""
    pp_p2p_s: float = 0.0
    """Point-to-point activation and gradient transfers on the slowest stage's critical path."""
    ep_degree: int = Layout.ep_degree
    moe_comm_s: float = 0.0
    """A mixture of experts' collectives inside forward and backward, on the critical path: the
    all-to-alls that carry tokens to their experts and back, and the routing statistics'
    all-reduces over the data-parallel ranks."""
    all_to_all_bytes: float = 0.0
    """Bytes each rank sends to other ranks through the all-to-alls of one update."""
    expert_bytes_per_rank: float = 0.0
    """Of ``memory_bytes_per_rank``, the routed experts' weights, gradients and Adam state that
    expert parallel leaves whole on this rank (0 without expert parallel: they count with the
    dense parameters, sharded as the strategy shards them)."""

    def to_dict(self) -> dict[str, Any]:
        return {k: (round(v, 6) if isinstance(v, float) else v) for k, v in dataclasses.asdict(self).items()}


# --------------------------------------------------------------------------- memory






def rank_parameters(workload: Workload, layout: Placement) -> LocalParameters:
    """``local_parameters`` of the part of the model this rank runs: under pipeline
    parallel, its stage's blocks, the embedding on the first stage and the final norm and
    output on the last (a tied output keeps its own copy of the embedding there)."""
    local = local_parameters(workload.shape, layout.tp, layout.ep)
    stage = workload.stage
    if stage is None:
        return local
    keeps_embedding = stage.first or (stage.last and workload.shape.tied_output)
    return dataclasses.replace(
        local,
        embedding=local.embedding if keeps_embedding else 0.0,
        head=local.head if stage.last else 0.0,
        matmul_head=local.matmul_head if stage.last else 0.0,
        matmul_embedding=local.matmul_embedding if stage.last else 0.0,
    )


def memory_per_rank(workload: Workload, layout: Placement) -> dict[str, float]:
    """Bytes per rank in parameters, gradients and Adam state, sharded by strategy as the
    ZeRO formulas say (``zero_formula_bytes``: DDP 16Ψ, ZeRO-1 4Ψ + 4Ψ + 8Ψ/N, FSDP 16Ψ/N with
    the fp32 weights of the planned precisions), with Ψ the tensor-parallel rank's share; plus an
    activation estimate. Under expert parallel the dense strategy holds the dense parameters
    only, and each rank its share of the experts whole (``expert_bytes``)."""
    local = rank_parameters(workload, layout)
    held = zero_formula_bytes(local.dense_total, layout.dp, ZERO_STAGES[workload.layout.strategy],
                              precision=workload.precision)
    experts = zero_formula_bytes(local.experts, 1, 0, precision=workload.precision)
    held = {key: held[key] + experts[key] for key in held}
    return {**held, "expert_bytes": experts["total_bytes"],
            "activation_bytes": activation_bytes_per_rank(workload, layout)}


def activation_bytes_per_rank(workload: Workload, layout: Placement) -> float:
    """Estimated bytes kept for backward by one micro-batch (Korthikanti et al. 2022 per
    block, plus fp32 logits and their gradient); with activation checkpointing, each
    block's input plus one block recomputed at a time."""
    s, tp = workload.shape, layout.tp
    tokens = workload.tokens_per_micro_batch
    scale = workload.activation_bytes / 2
    if tp == 1:
        per_unit = ACTIVATION_BYTES_PER_TOKEN_UNIT
    elif workload.layout.sequence_parallel:
        per_unit = ACTIVATION_BYTES_PER_TOKEN_UNIT / tp
    else:
        per_unit = 10 + 24 / tp
    block = tokens * s.dim * per_unit * scale
    if s.n_experts:
        block += tokens * (moe_mlp_bytes_per_token(s) - s.n_moe_layers / s.n_layers * DENSE_MLP_BYTES_PER_TOKEN_UNIT
                           * s.dim) * scale
    if workload.layout.activation_checkpointing:
        inputs = tokens * s.dim * workload.activation_bytes / (tp if workload.layout.sequence_parallel else 1)
        blocks = s.n_layers * inputs + block
    else:
        blocks = s.n_layers * block
    # Logits of the positions the model outputs at, each rank's share of the vocabulary where
    # tensor parallel splits the output projection.
    split = tp if registry.family(s.family).sizes.output_split_by_tp else 1
    vocab = s.vocab_size / split * workload.output_fraction
    logits = tokens * vocab * 4 * 2 if workload.stage is None or workload.stage.last else 0.0
    return blocks + logits


def moe_mlp_bytes_per_token(shape: ModelShape) -> float:
    """Bytes a mixture-of-experts feed-forward keeps for backward per token, 16-bit
    activations, averaged over the blocks: its input (2h); each of its top-k copies routed to
    an expert and its output back (2h + 2h), the expert's gate and up outputs, the silu and
    the product (2F + F + F, 2 bytes each); the router's fp32 probabilities (4E, and their
    softmax's output again); shared experts as a SwiGLU of their width."""
    h, f, k = shape.dim, shape.moe_ffn_dim, shape.top_k
    shared = shape.n_shared_experts * f
    per_layer = 2 * h + k * (4 * h + 8 * f) + 8 * shape.n_experts + (8 * shared if shared else 0)
    return shape.n_moe_layers / shape.n_layers * per_layer


# -------------------------------------------------------------------------- compute


@dataclass(frozen=True)
class Segment:
    """A stretch of forward or backward: its compute seconds and, in backward, the
    gradient parameters it completes (per rank)."""

    seconds: float
    params: float


def micro_batch_segments(
    workload: Workload, layout: Placement, cluster: Cluster
) -> tuple[list[Segment], list[Segment], float]:
    """Forward segments (embedding, blocks, head) and backward segments (head, blocks in
    reverse, embedding) of one micro-batch on one rank, with the tensor-parallel
    all-reduces and a mixture of experts' collectives (``moe_block_seconds``) inside the
    block segments; and the micro-batch's tensor-parallel seconds.

    A tied output projection multiplies in the head but its gradient, accumulated with
    the embedding lookup's, is complete only when the embedding's backward is.
    """
    s, tp = workload.shape, layout.tp
    local = rank_parameters(workload, layout)
    tokens = workload.tokens_per_micro_batch
    flops_rate = cluster.achieved_flops_per_rank(workload.precision) / compute_slowdown(layout, cluster)
    # Forward FLOPs per token: 2 per multiplied parameter (a mixture of experts' token
    # multiplies its top-k experts only), and 4 x heads x head size x T for the QK^T and AV
    # products (the heads are split over the tensor-parallel ranks).
    attention = 4.0 * s.attention_dim * workload.tokens_per_sample / tp
    fwd_block = tokens * (2 * local.compute_per_block + attention) / flops_rate
    head_tokens = tokens * workload.output_fraction
    fwd_head = head_tokens * 2 * (local.matmul_head + local.matmul_embedding) / flops_rate
    recompute = fwd_block if workload.layout.activation_checkpointing else 0.0
    # Tensor parallel: two activation all-reduces per block in forward (after attention and
    # after the feed-forward) and two in backward (their input gradients), as all-reduces
    # or, with sequence parallel, as all-gathers + reduce-scatters of the same bytes.
    tp_allreduce = collective_time("all_reduce", tokens * s.dim * workload.activation_bytes, Group(tp, 1), cluster)
    tp_fwd = 2 * tp_allreduce
    tp_bwd = 2 * tp_allreduce + (tp_fwd if workload.layout.activation_checkpointing else 0.0)
    # A mixture of experts' collectives ride with the tensor-parallel ones, on the critical path.
    moe_fwd, moe_bwd = moe_block_seconds(workload, layout, cluster)
    forward = [Segment(0.0, 0.0)] + [Segment(fwd_block + tp_fwd + moe_fwd, 0.0)] * s.n_layers + [Segment(fwd_head, 0.0)]
    backward = (
        [Segment(2 * fwd_head, local.head)]
        + [Segment(2 * fwd_block + recompute + tp_bwd + moe_bwd, local.per_block)] * s.n_layers
        + [Segment(0.0, local.embedding)]
    )
    return forward, backward, s.n_layers * (tp_fwd + tp_bwd)


# ------------------------------------------------------------------- mixture of experts




def all_to_all_time(nbytes: float, group: Group, cluster: Cluster) -> float:
    """An all-to-all in which each rank of ``group`` sends ``nbytes`` spread evenly over the
    ranks, its own share staying: ``(p-1)/p x n`` leave each rank at once, over the group's
    link (a node's network shared by its ranks), after ``p - 1`` latency steps."""
    if group.ranks <= 1 or nbytes <= 0:
        return 0.0
    link = group_link(group, cluster)
    return (group.ranks - 1) * link.latency_s + (group.ranks - 1) / group.ranks * nbytes / link.bandwidth_Bps


def all_to_all_bytes_per_micro(workload: Workload, layout: Placement) -> float:
    """Bytes one rank sends to others through the all-to-alls of one micro-batch: per MoE
    layer, its tokens' top-k copies to their experts and the results back, in forward and
    again (their gradients) in backward, once more in forward when activation checkpointing
    recomputes; routing assumed even, so ``(ep-1)/ep`` of the copies leave the rank."""
    s, ep = workload.shape, layout.ep
    if not s.n_experts or ep <= 1:
        return 0.0
    copies = workload.tokens_per_micro_batch * s.top_k * s.dim * workload.activation_bytes
    exchanges = 4 + (2 if workload.layout.activation_checkpointing else 0)
    return s.n_moe_layers * exchanges * copies * (ep - 1) / ep


def moe_block_seconds(workload: Workload, layout: Placement, cluster: Cluster) -> tuple[float, float]:
    """(forward, backward) seconds of a mixture of experts' collectives per block of one
    micro-batch, averaged over the blocks: each MoE layer's two all-to-alls in forward (the
    tokens to their experts, the results back; each after an all-to-all of the counts) and
    two in backward, and its routing statistics summed over the data-parallel ranks (one
    all-reduce of ``2E + 1`` numbers in every forward, the recomputed one included); 0 for a
    dense model."""
    s = workload.shape
    if not s.n_experts:
        return 0.0, 0.0
    share = s.n_moe_layers / s.n_layers
    copies = workload.tokens_per_micro_batch * s.top_k * s.dim * workload.activation_bytes
    group = layout.ep_group()
    exchange = 2 * (all_to_all_time(copies, group, cluster) + all_to_all_time(8 * s.n_experts, group, cluster))
    statistics = collective_time("all_reduce", 8 * (2 * s.n_experts + 1), layout.dp_group(), cluster, "auto")
    forward = exchange + statistics
    backward = exchange + (forward if workload.layout.activation_checkpointing else 0.0)
    return share * forward, share * backward


def expert_gradient_seconds(workload: Workload, layout: Placement, cluster: Cluster) -> float:
    """The experts' gradients summed over the ranks holding the same experts: one all-reduce
    of them all once backward is done (distlm's ``ExpertGradients``), on the critical path; 0
    without expert parallel (the dense strategy reduces them) or with one group."""
    experts = rank_parameters(workload, layout).experts
    return collective_time("all_reduce", 4 * experts, layout.expert_replica_group(), cluster,
                           workload.allreduce_algorithm) if experts else 0.0


def executed_flops_per_token(shape: ModelShape, seq_len: int, mask_prob: float = DataConfig.mask_prob) -> float:
    """FLOPs per token the step really runs, as ``micro_batch_segments`` times them:
    ``flops_per_token`` with a masked LM's head (and its tied projection) at the masked
    share of positions only. Calibration divides these by the measured compute time."""
    return flops_per_token(shape, seq_len, registry.family(shape.family).task.output_fraction(mask_prob))


def optimizer_seconds(workload: Workload, layout: Placement, cluster: Cluster) -> float:
    """The memory-bound AdamW step over the parameters this rank updates; with FSDP's
    sharded gradients, clipping adds an all-reduce of the squared norm. Parameters held as
    DTensors (FSDP, tensor parallel) add DTensor's dispatch for every tensor, however
    small its shard."""
    local = rank_parameters(workload, layout)
    dense = local.dense_total if workload.layout.strategy == "ddp" or layout.dp == 1 else local.dense_total / layout.dp
    updated = dense + local.experts  # expert parallel's experts are updated whole where they live
    seconds = updated * ADAM_BYTES_PER_PARAM / cluster.memory_bandwidth_Bps
    fsdp = workload.layout.strategy == "fsdp" and layout.dp > 1
    if fsdp or layout.tp > 1:
        seconds += cluster.dtensor_step_per_tensor_s * count_parameter_tensors(workload.shape)
    seconds *= memory_slowdown(layout, cluster)
    if fsdp:
        seconds += collective_time("all_reduce", 4, layout.dp_group(), cluster, "auto")
    return seconds


# ------------------------------------------------------------------- data parallel


def gradient_allreduce_time(nbytes: float, workload: Workload, layout: Placement, cluster: Cluster) -> float:
    """One DDP bucket of ``nbytes`` fp32 gradient bytes through the layout's comm hook."""
    group = layout.dp_group()
    hook = workload.layout.hook
    factor = 1.0 if hook.wire_dtype is None else DTYPES[hook.wire_dtype].itemsize / 4  # of the fp32 bytes, on the wire
    if not hook.hierarchical:
        return collective_time("all_reduce", nbytes * factor, group, cluster, workload.allreduce_algorithm)
    return hierarchical_allreduce_time(
        nbytes, layout.nodes, layout.ranks_per_node, cluster, factor, workload.allreduce_algorithm
    )


def _bucket_boundaries(total_bytes: float, cap_bytes: float) -> list[float]:
    """Cumulative byte offsets where DDP's buckets end, in the order backward fills them."""
    ends, position = [], 0.0
    first = min(DDP_FIRST_BUCKET_BYTES, total_bytes)
    for size in [first] + [cap_bytes] * math.ceil(max(total_bytes - first, 0.0) / cap_bytes):
        position = min(total_bytes, position + size)
        ends.append(position)
    return ends


def _ready_time(byte_offset: float, backward: list[Segment]) -> float:
    """When backward has produced ``byte_offset`` gradient bytes (linear within a segment)."""
    elapsed, produced = 0.0, 0.0
    for segment in backward:
        nbytes = 4 * segment.params
        if nbytes > 0 and produced + nbytes >= byte_offset - 1e-6:
            return elapsed + segment.seconds * (byte_offset - produced) / nbytes
        produced += nbytes
        elapsed += segment.seconds
    return elapsed


def ddp_communication(
    workload: Workload, layout: Placement, cluster: Cluster, backward: list[Segment]
) -> list[tuple[float, float, float]]:
    """``(ready, end, seconds)`` of each gradient bucket of one update, in seconds from the
    start of the last micro-batch's backward: buckets are all-reduced one after another,
    each once backward has filled it and the previous one is done. A bucket filled before
    backward ends runs beside compute (``collective_slowdown``); with double buffering
    every bucket does, beside the next update."""
    total_bytes = 4 * sum(segment.params for segment in backward)
    backward_seconds = sum(segment.seconds for segment in backward)
    slowdown = collective_slowdown(layout, cluster)
    buckets, comm_free, previous = [], 0.0, 0.0
    for end in _bucket_boundaries(total_bytes, workload.layout.bucket_cap_mb * MIB):
        seconds = gradient_allreduce_time(end - previous, workload, layout, cluster)
        ready = _ready_time(end, backward)
        if workload.layout.double_buffering or ready < backward_seconds * (1 - 1e-9):
            seconds *= slowdown
        comm_free = max(ready, comm_free) + seconds
        buckets.append((ready, comm_free, seconds))
        previous = end
    return buckets


def exposed_ddp_seconds(
    buckets: list[tuple[float, float, float]], backward_seconds: float, period: float | None
) -> float:
    """Communication seconds the update waits for. Plain DDP waits after backward for the
    buckets still in flight: all but the tail hid behind the remaining backward. With
    double buffering (``period``: the update's compute and optimizer seconds), bucket k of
    update t is awaited when update t+1's backward fills bucket k, a period later; in steady
    state the update also stretches to the total communication when that exceeds the period."""
    if not buckets:
        return 0.0
    if period is None:
        return max(0.0, buckets[-1][1] - backward_seconds)
    latest = max(end - ready for ready, end, _ in buckets)
    total = sum(seconds for _, _, seconds in buckets)
    return max(0.0, latest - period, total - period)


def fsdp_micro_batch(
    workload: Workload, layout: Placement, cluster: Cluster, forward: list[Segment], backward: list[Segment],
    reduce: bool, overlap: bool = True,
) -> tuple[float, float, float]:
    """(elapsed, communication, copy) seconds of one FSDP micro-batch: per-block
    all-gathers prefetched one block ahead on one communication stream, the last block
    kept gathered after forward, the root's parameters gathered once, and each block's
    gradients reduce-scattered (fp32) after its backward when ``reduce``.

    FSDP2 copies each all-gather's shards into its input buffer and the gathered buffer
    out to the parameters (2 x bytes x (1 + 1/p) of memory traffic), and each block's
    gradients into the reduce-scatter's input (2 x 4 bytes a parameter); these copies run
    on the rank's compute at its memory bandwidth. Without ``overlap`` (CPU ranks on busy
    cores) every collective and copy adds to the compute. The prefetched all-gathers and
    the reduce-scatters with blocks still to run backward go beside compute
    (``collective_slowdown``); the first two all-gathers and the last two reduce-scatters,
    which the rank waits for, do not."""
    group = layout.dp_group()
    gather_bytes = workload.activation_bytes
    local = rank_parameters(workload, layout)
    n = workload.shape.n_layers
    copy_rate = cluster.memory_bandwidth_Bps / memory_slowdown(layout, cluster)
    slowdown = collective_slowdown(layout, cluster)

    def gather(params: float) -> float:
        return collective_time("all_gather", params * gather_bytes, group, cluster)

    def gather_copies(params: float) -> float:
        return 2 * params * gather_bytes * (1 + 1 / group.ranks) / copy_rate

    def scatter(params: float) -> float:
        return collective_time("reduce_scatter", params * 4, group, cluster) if reduce else 0.0

    def scatter_copies(params: float) -> float:
        return 2 * 4 * params / copy_rate if reduce else 0.0

    comm_free = 0.0
    comm_total = 0.0

    def communicate(ready: float, seconds: float, beside_compute: bool = True) -> float:
        nonlocal comm_free, comm_total
        seconds *= slowdown if beside_compute else 1.0
        comm_free = max(ready, comm_free) + seconds
        comm_total += seconds
        return comm_free

    root = local.embedding + local.head
    root_ready = communicate(0.0, gather(root), beside_compute=False)
    gathered = {0: communicate(0.0, gather(local.per_block), beside_compute=False)}
    copies = gather_copies(root)
    clock = root_ready + copies + forward[0].seconds
    for i in range(n):
        clock = max(clock, gathered[i]) + gather_copies(local.per_block)
        copies += gather_copies(local.per_block)
        if i + 1 < n:
            gathered[i + 1] = communicate(clock, gather(local.per_block))
        clock += forward[1 + i].seconds
    clock += forward[-1].seconds
    # Backward: head, then blocks n-1 .. 0 (block n-1 stayed gathered after forward; each
    # block's pre-backward prefetches the next one's all-gather), then the embedding.
    clock += backward[0].seconds
    regathered = {n - 1: 0.0}
    for i in reversed(range(n)):
        if i < n - 1:
            clock = max(clock, regathered[i]) + gather_copies(local.per_block)
            copies += gather_copies(local.per_block)
        if i >= 1:
            regathered[i - 1] = communicate(clock, gather(local.per_block))
        clock += backward[n - i].seconds + scatter_copies(local.per_block)
        copies += scatter_copies(local.per_block)
        communicate(clock, scatter(local.per_block), beside_compute=i >= 1)
    clock += backward[-1].seconds + scatter_copies(root)
    copies += scatter_copies(root)
    end = max(clock, communicate(clock, scatter(root), beside_compute=False))
    if not overlap:
        compute = sum(segment.seconds for segment in forward) + sum(segment.seconds for segment in backward)
        end = compute + comm_total + copies
    return end, comm_total, copies


# ------------------------------------------------------------------ pipeline parallel

def pipeline_stages(n_layers: int, pp: int, schedule: str) -> list[Stage]:
    """Each rank's stage: the blocks split as evenly as they go (the first stages take one
    more), the embedding on rank 0, the head on the last rank, or on rank 0 again for
    zbv, whose V shape ends where it starts."""
    base, extra = divmod(n_layers, pp)
    last = 0 if schedule == "zbv" else pp - 1
    return [Stage(index=i, blocks=base + (i < extra), first=i == 0, last=i == last) for i in range(pp)]


def bubble_slots(pp: int, schedule: str, stages_per_rank: int) -> float:
    """Idle slots of one pipeline pass, in units of one micro-batch's forward and backward on a stage.

    GPipe and 1F1B fill and drain the pipeline: P-1 slots, so the bubble is (P-1)/(M+P-1)
    of a pass of M micro-batches. Interleaving V stages per rank makes each slot V times
    shorter: (P-1)/V (Narayanan et al. 2021). The zero-bubble schedules have no such formula:
    ``zero_bubble_pass`` plays their passes out.
    """
    if schedule in ("gpipe", "1f1b"):
        return pp - 1
    if schedule == "interleaved-1f1b":
        return (pp - 1) / stages_per_rank
    raise ValueError(f"{schedule}: the zero-bubble schedules' bubble comes from zero_bubble_pass")


def zero_bubble_pass(schedule: str, pp: int, microbatches: int, stages_per_rank: int, compute_s: float,
                     p2p_s: float, update_freq: int, tail_s: float) -> tuple[float, float, float]:
    """(compute, bubble, step seconds) of an update under a zero-bubble schedule, whose passes
    are played out as torch runs them (distlm/plan/schedule.py). ``compute_s`` is a stage's
    forward and backward of one micro-batch; each of its V chunks takes 1/V of it, a third
    forward and two thirds backward (twice the forward's FLOPs), the backward split evenly
    between its input and weight gradients, each charged SPLIT_BACKWARD_COST more."""
    chunk = compute_s / stages_per_rank
    backward_half = chunk / 3 * SPLIT_BACKWARD_COST
    times = ActionTimes(forward=chunk / 3, input_grad=backward_half, weight_grad=backward_half, transfer=p2p_s)
    one_pass = pass_seconds(zero_bubble_orders(schedule, pp, microbatches, stages_per_rank), schedule, times)
    work = update_freq * microbatches * stages_per_rank * (times.forward + times.input_grad + times.weight_grad)
    return work, update_freq * one_pass - work, update_freq * one_pass + tail_s


def inflight_microbatches(stage: Stage, pp: int, microbatches: int, schedule: str, stages_per_rank: int) -> float:
    """Micro-batches whose activations ``stage`` holds at its peak, in units of its
    activations for one micro-batch.

    GPipe runs every forward first: M. 1F1B holds P - s on stage s (the first stage P),
    as do the zero-bubble V schedule's ranks (P each). Interleaved schedules warm up with
    2(P-s-1) + (V-1)P + 1 chunk forwards of 1/V of a stage each (Megatron's schedule;
    P + (P-1)/V on the first rank).
    """
    p, m, v, s = pp, microbatches, stages_per_rank, stage.index
    if schedule == "gpipe":
        return m
    if schedule == "1f1b":
        return min(m, p - s)
    if schedule == "zbv":
        return min(m, p)
    return min(m * v, 2 * (p - s - 1) + (v - 1) * p + 1) / v


def p2p_seconds(workload: Workload, layout: Placement, cluster: Cluster) -> float:
    """One transfer between neighbouring stages: a pipeline micro-batch's [b, T, dim]
    activations (or their gradient) in the activation dtype, each tensor-parallel rank its
    copy (its sequence shard under sequence parallel). Stages are blocks of consecutive
    ranks, so a boundary crosses the network once there are several nodes, and then the
    ranks of a node send across it at once, sharing its network."""
    nbytes = workload.tokens_per_micro_batch * workload.shape.dim * workload.activation_bytes
    if workload.layout.sequence_parallel:
        nbytes /= layout.tp
    if layout.nodes == 1:
        return cluster.intra.transfer_s(nbytes)
    sending = min(layout.ranks_per_node, layout.world // layout.pp)
    return group_link(Group(ranks=2, nodes=2, concurrent=sending), cluster).transfer_s(nbytes)


def project_pipeline(workload: Workload, cluster: Cluster, layout: Placement) -> Projection:
    """Project one update under pipeline parallel: every stage projected on its own (a
    pipeline micro-batch at a time, ``update_freq`` passes of M), then the passes set by the
    slowest stage's slot, the bubble and the transfers; the memory of the rank that needs most."""
    validate(workload, cluster, layout)
    pipeline = workload.layout.pipeline
    m, v, uf = pipeline.microbatch_count(layout.pp), pipeline.stages_per_rank, workload.update_freq
    stages = pipeline_stages(workload.shape.n_layers, layout.pp, pipeline.schedule)
    staged = {
        stage.index: dataclasses.replace(
            workload, shape=dataclasses.replace(workload.shape, n_layers=stage.blocks),
            batch_size=workload.batch_size // m, update_freq=uf * m, stage=stage,
        )
        for stage in stages
    }
    projected: dict[tuple, Projection] = {}  # stages alike but for their index project alike
    for stage in stages:
        key = (stage.blocks, stage.first, stage.last)
        if key not in projected:
            projected[key] = project(staged[stage.index], cluster, layout)
    row_of = {stage.index: projected[stage.blocks, stage.first, stage.last] for stage in stages}
    rows = list(projected.values())
    slowest = max(rows, key=lambda row: row.compute_s + row.tp_comm_s)
    p2p = p2p_seconds(staged[0], layout, cluster)
    slot = (slowest.compute_s + slowest.tp_comm_s) / (uf * m) + 2 * p2p
    # After the passes: the stage's optimizer step and whatever of its data-parallel
    # communication backward did not hide; the pipeline waits for the slowest.
    tail = max(row.step_time_s - row.compute_s - row.tp_comm_s for row in rows)
    if pipeline.splits_backward:
        work, bubble, step = zero_bubble_pass(pipeline.schedule, layout.pp, m, v, slot - 2 * p2p, p2p, uf, tail)
    else:
        bubble = uf * bubble_slots(layout.pp, pipeline.schedule, v) * slot
        step = uf * m * slot + bubble + tail
        work = uf * m * (slot - 2 * p2p)
    # Memory: the rank whose stage state plus activations in flight need most.
    held = {
        stage.index: row_of[stage.index].activation_bytes_per_rank
        * inflight_microbatches(stage, layout.pp, m, pipeline.schedule, v)
        for stage in stages
    }
    peak = max(stages, key=lambda stage: row_of[stage.index].memory_bytes_per_rank + held[stage.index])
    heaviest, activations = row_of[peak.index], held[peak.index]
    optimizer = max(row.optimizer_s for row in rows)
    samples = workload.batch_size * uf * layout.dp
    tokens_per_s = samples * workload.tokens_per_sample / step
    flops = flops_per_token(workload.shape, workload.tokens_per_sample)
    # A stage row's ideal is its compute and optimizer with no data-parallel communication;
    # the pipeline's is its slowest stage's, with no bubble and no transfers.
    ideal = max(row.efficiency * row.step_time_s for row in rows)
    return dataclasses.replace(
        slowest,
        step_time_s=step,
        tokens_per_s=tokens_per_s,
        samples_per_s=samples / step,
        global_batch_size=samples,
        update_freq=uf,
        efficiency=ideal / step,
        mfu=tokens_per_s * flops / (cluster.peak_flops_per_rank(dtype_name(workload.precision)) * layout.world),
        dp_comm_s=max(row.dp_comm_s for row in rows),
        fsdp_copy_s=max(row.fsdp_copy_s for row in rows),
        comm_exposed_s=max(0.0, step - work - bubble - optimizer),
        optimizer_s=optimizer,
        param_bytes=heaviest.param_bytes,
        grad_bytes=heaviest.grad_bytes,
        optimizer_bytes=heaviest.optimizer_bytes,
        memory_bytes_per_rank=heaviest.memory_bytes_per_rank,
        activation_bytes_per_rank=activations,
        fits=heaviest.memory_bytes_per_rank + activations <= cluster.memory_bytes_per_rank,
        pp_degree=layout.pp,
        pp_schedule=pipeline.schedule,
        pp_microbatches=m,
        pp_stages_per_rank=v,
        pp_bubble_s=bubble,
        pp_p2p_s=uf * m * 2 * p2p,
    )


def validate_pipeline(workload: Workload, layout: Placement) -> None:
    """Refuse the pipeline layouts distlm.train refuses (one line each)."""
    if layout.world % (layout.tp * layout.pp):
        raise UsageError(
            f"--pp-degree {layout.pp} x --tp-degree {layout.tp} does not divide the world size {layout.world}; "
            "choose degrees whose product divides it"
        )
    if layout.pp == 1 or workload.stage is not None:  # a stage's own projection: checked for the whole
        return
    pipeline = workload.layout.pipeline
    pipeline.check_stages_per_rank()
    blocks, v = workload.shape.n_layers, pipeline.stages_per_rank
    if layout.pp * v > blocks:
        raise UsageError(f"--pp-degree {layout.pp} x {v} stages per rank exceeds the model's {blocks} "
                         f"block{'s' if blocks != 1 else ''}; lower --pp-degree")
    pipeline.check_microbatches(layout.pp, workload.batch_size)


# ------------------------------------------------------------------------ projection


def project(workload: Workload, cluster: Cluster, layout: Placement) -> Projection:
    """Project one update of ``workload`` on ``layout`` over ``cluster``."""
    if layout.pp > 1 and workload.stage is None:
        return project_pipeline(workload, cluster, layout)
    validate(workload, cluster, layout)
    workload = dataclasses.replace(workload, precision=dtype_name(workload.precision))
    forward, backward, tp_per_micro = micro_batch_segments(workload, layout, cluster)
    micro = sum(segment.seconds for segment in forward) + sum(segment.seconds for segment in backward)
    uf = workload.update_freq
    optimizer = optimizer_seconds(workload, layout, cluster)
    tp_comm = uf * tp_per_micro
    moe_comm = uf * workload.shape.n_layers * sum(moe_block_seconds(workload, layout, cluster))
    compute = uf * micro - tp_comm - moe_comm
    dp_enabled = layout.dp > 1
    overlap = communication_overlaps(layout, cluster)

    copies = 0.0
    if workload.layout.strategy == "fsdp" and dp_enabled:
        elapsed, comm_total = 0.0, 0.0
        for index in range(uf):
            seconds, comm, copy = fsdp_micro_batch(
                workload, layout, cluster, forward, backward, reduce=index == uf - 1, overlap=overlap
            )
            elapsed += seconds
            comm_total += comm
            copies += copy
        step = elapsed + optimizer
    else:
        buckets = ddp_communication(workload, layout, cluster, backward) if dp_enabled else []
        comm_total = sum(seconds for _, _, seconds in buckets)
        period = uf * micro + optimizer if workload.layout.double_buffering else None
        backward_seconds = sum(segment.seconds for segment in backward)
        exposed_buckets = exposed_ddp_seconds(buckets, backward_seconds, period) if overlap else comm_total
        step = uf * micro + optimizer + exposed_buckets
        if workload.layout.strategy == "zero1" and dp_enabled:
            local = rank_parameters(workload, layout).dense_total
            sync = collective_time("all_gather", 4 * local, layout.dp_group(), cluster)
            comm_total += sync
            step += sync
    experts = expert_gradient_seconds(workload, layout, cluster)
    comm_total += experts
    step += experts

    if dp_enabled:
        # distlm normalises the loss by the global target-token count: one all-reduce of a
        # number before the update's first forward, on the critical path (a message this
        # small goes the fewest-latency way, as NCCL picks a tree for it).
        token_count = collective_time("all_reduce", 8, layout.dp_group(), cluster, "auto")
        comm_total += token_count
        step += token_count
    exposed = max(0.0, step - uf * micro - optimizer)  # clamps float noise when nothing is exposed
    # One replica alone (no data-parallel communication, nothing sharded, no other
    # replica sharing its cores) sets the ideal.
    single = layout.one_replica()
    single_forward, single_backward, _ = micro_batch_segments(workload, single, cluster)
    single_micro = sum(segment.seconds for segment in single_forward + single_backward)
    replicated = dataclasses.replace(workload, layout=dataclasses.replace(workload.layout, strategy="ddp"))
    ideal_step = uf * single_micro + optimizer_seconds(replicated, single, cluster)
    samples = workload.batch_size * uf * layout.dp
    tokens_per_s = samples * workload.tokens_per_sample / step
    memory = memory_per_rank(workload, layout)
    peak = cluster.peak_flops_per_rank(workload.precision)
    mfu = tokens_per_s * flops_per_token(workload.shape, workload.tokens_per_sample) / (peak * layout.world)
    return Projection(
        nodes=layout.nodes,
        ranks=layout.world,
        ranks_per_node=layout.ranks_per_node,
        dp_degree=layout.dp,
        tp_degree=layout.tp,
        global_batch_size=samples,
        update_freq=uf,
        step_time_s=step,
        tokens_per_s=tokens_per_s,
        samples_per_s=samples / step,
        efficiency=ideal_step / step,
        mfu=mfu,
        compute_slowdown=compute_slowdown(layout, cluster),
        compute_s=compute,
        tp_comm_s=tp_comm,
        dp_comm_s=comm_total,
        fsdp_copy_s=copies,
        comm_exposed_s=exposed,
        optimizer_s=optimizer,
        param_bytes=memory["param_bytes"],
        grad_bytes=memory["grad_bytes"],
        optimizer_bytes=memory["optimizer_bytes"],
        memory_bytes_per_rank=memory["total_bytes"],
        activation_bytes_per_rank=memory["activation_bytes"],
        device_memory_bytes=cluster.memory_bytes_per_rank,
        fits=memory["total_bytes"] + memory["activation_bytes"] <= cluster.memory_bytes_per_rank,
        ep_degree=layout.ep,
        moe_comm_s=moe_comm,
        all_to_all_bytes=uf * all_to_all_bytes_per_micro(workload, layout),
        expert_bytes_per_rank=memory["expert_bytes"],
    )


def validate(workload: Workload, cluster: Cluster, layout: Placement) -> None:
    """Refuse what distlm itself would refuse, and layouts the model cannot describe."""
    s = workload.shape
    asked = (workload.layout.tp_degree, workload.layout.pp_degree, workload.layout.ep_degree)
    if asked != (layout.tp, layout.pp, layout.ep):
        raise ValueError(f"the workload's layout has tp, pp, ep degrees {asked}, its placement "
                         f"{(layout.tp, layout.pp, layout.ep)}; place the workload's own layout")
    check_shared_settings({
        **workload.layout.settings(), "tokens_per_sample": workload.tokens_per_sample,
        "batch_size": workload.batch_size, "update_freq": workload.update_freq,
    })
    if workload.allreduce_algorithm not in ALLREDUCE_ALGORITHMS:
        raise UsageError(
            f"--allreduce-algorithm {workload.allreduce_algorithm} is unknown; "
            f"choose one of {', '.join(ALLREDUCE_ALGORITHMS)}"
        )
    dtype_name(workload.precision)
    if workload.tokens_per_sample > s.max_positions:
        raise UsageError(
            f"--tokens-per-sample {workload.tokens_per_sample} exceeds the model's {s.max_positions} positions; "
            "lower it"
        )
    hooks_asked = workload.layout.hooks_asked
    if hooks_asked and layout.ep > 1:
        raise UsageError(f"--comm-hook/--double-buffering are DDP communication hooks, and with --ep-degree "
                         f"{layout.ep} the dense parameters are not in torch DDP; drop them")
    if hooks_asked and workload.layout.strategy == "fsdp":
        raise UsageError(
            "--comm-hook/--double-buffering are DDP communication hooks; FSDP reduce-scatters its own "
            "gradients: use --strategy ddp or zero1"
        )
    if hooks_asked and layout.tp > 1:
        raise UsageError(
            "--comm-hook/--double-buffering are DDP communication hooks, and DDP cannot hold tensor-parallel "
            "parameters; use --tp-degree 1"
        )
    if layout.nodes < 1 or layout.ranks_per_node < 1:
        raise UsageError(f"nodes and ranks per node must be at least 1, got {layout.nodes} x {layout.ranks_per_node}")
    if layout.ranks_per_node % layout.tp:
        raise UsageError(
            f"--tp-degree {layout.tp} must divide the {layout.ranks_per_node} ranks of a node "
            "(tensor parallel stays inside a node)"
        )
    divisible = {"n_heads": s.n_heads, "ffn_dim": s.ffn_dim}
    for name, value in divisible.items():
        if value % layout.tp:
            raise UsageError(f"--tp-degree {layout.tp} must divide the model's {name}={value}")
    if s.n_kv_heads % layout.tp and layout.tp % s.n_kv_heads:
        raise UsageError(
            f"--tp-degree {layout.tp} must divide the model's n_kv_heads={s.n_kv_heads} or be a multiple of it"
        )
    if workload.layout.sequence_parallel and layout.tp == 1:
        raise UsageError("--sequence-parallel shards along tensor-parallel ranks; set --tp-degree > 1")
    validate_experts(workload, layout)
    validate_pipeline(workload, layout)


def validate_experts(workload: Workload, layout: Placement) -> None:
    """Refuse the mixture-of-experts layouts distlm.train refuses (one line each)."""
    s, ep = workload.shape, layout.ep
    if ep < 1:
        raise UsageError(f"--ep-degree must be at least 1, got {ep}")
    if ep > 1 and not s.n_experts:
        raise UsageError(f"--ep-degree {ep} splits the experts of MoE layers, and the model has none; "
                         "drop --ep-degree or plan a mixture of experts")
    if s.n_experts and layout.tp > 1:
        raise UsageError(f"--tp-degree {layout.tp} with a mixture of experts is not offered yet; use --ep-degree")
    if s.n_experts and layout.pp > 1:
        raise UsageError(f"--pp-degree {layout.pp}: pipeline stages of a mixture of experts are not offered yet; "
                         "use --pp-degree 1")
    if ep == 1:
        return
    if layout.dp % ep:
        raise UsageError(f"--ep-degree {ep} does not divide the {layout.dp} data-parallel ranks it is carved "
                         "out of; choose a divisor of the data-parallel degree")
    if s.n_experts % ep:
        raise UsageError(f"--ep-degree {ep} does not divide the {s.n_experts} experts of each MoE layer; "
                         f"choose a divisor of {s.n_experts}")
    if workload.layout.strategy == "zero1":
        raise UsageError(f"--ep-degree {ep} with --strategy zero1 is not offered: torch's ZeroRedundancyOptimizer "
                         "cannot hold the experts' DTensor parameters; use --strategy ddp or fsdp")


def placements(cluster: Cluster, nodes: list[int] | None, ranks: list[int] | None, layout: Layout) -> list[Placement]:
    """``layout`` placed once per node count, or per total rank count (a count below one
    node's ranks is one partly used node)."""
    if nodes is not None and ranks is not None:
        raise UsageError("give --nodes or --ranks, not both")
    rpn = cluster.ranks_per_node
    if ranks is None:
        for count in nodes or [1]:
            if count < 1:
                raise UsageError(f"--nodes must be at least 1, got {count}")
        return [Placement(count, rpn, layout) for count in (nodes or [1])]
    result = []
    for count in ranks:
        if count < 1:
            raise UsageError(f"--ranks must be at least 1, got {count}")
        if count <= rpn:
            result.append(Placement(1, count, layout))
        elif count % rpn:
            raise UsageError(f"--ranks {count} is not a whole number of {rpn}-rank nodes of {cluster.name}")
        else:
            result.append(Placement(count // rpn, rpn, layout))
    return result


def resolve_batch(
    dp: int, batch_size: int | None, update_freq: int | None, global_batch_size: int | None
) -> tuple[int, int]:
    """(micro-batch per replica, micro-batches per update) from the flags, as distlm.train
    reads them; a global batch is split over the data-parallel replicas."""
    if global_batch_size is None:
        return batch_size or 16, update_freq or 1
    if global_batch_size < 1:
        raise UsageError(f"--global-batch-size must be at least 1, got {global_batch_size}")
    per_replica, rest = divmod(global_batch_size, dp)
    if rest or per_replica == 0:
        raise UsageError(f"--global-batch-size {global_batch_size} does not split over {dp} data-parallel replicas")
    micro = batch_size or max(1, per_replica // (update_freq or 1))
    steps, rest = divmod(per_replica, micro)
    if rest or (update_freq is not None and steps != update_freq):
        raise UsageError(
            f"--global-batch-size {global_batch_size} is {per_replica} samples per replica at dp {dp}, "
            f"not a whole number of --batch-size {micro} micro-batches"
            + (f" x --update-freq {update_freq}" if update_freq is not None else "")
        )
    return micro, steps
