"""ParallelDims: the one owner of the topology (strategy, degrees, their validation, named meshes).

A degree of 1 means that form of parallelism is off. The data-parallel degree is
whatever the other degrees leave of the world size. Meshes and groups are fetched by
name, and a rank's coordinates come from here, so strategies never compute rank
arithmetic of their own.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple, Sequence

import torch

import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from distlm.choices import STRATEGIES
from distlm.launch.hosts import ranks_by_node
from distlm.errors import UsageError


@dataclass
class ParallelDims:
    world_size: int
    dp: int = -1
    tp: int = 1
    pp: int = 1
    """Pipeline stages: the outermost mesh axis (pp, dp, tp), so a stage's dp x tp ranks are neighbours."""
    strategy: str = "ddp"
    """How the data-parallel axis holds the model: ddp (replicas), zero1 (replicas,
    sharded optimizer state) or fsdp (everything sharded)."""
    ep: int = 1
    """Expert parallel: groups of ``ep`` consecutive data-parallel ranks split each MoE layer's
    experts; the ranks at one place in their groups (``ep_replicas`` of them) hold the same experts."""
    _mesh: DeviceMesh | None = field(default=None, init=False, repr=False)
    _groups: dict[str, dist.ProcessGroup] = field(default_factory=dict, init=False, repr=False)
    """Each mesh dimension's group, sliced once: a slice builds a new DeviceMesh every time."""
    _ep_mesh: DeviceMesh | None = field(default=None, init=False, repr=False)

    def __post_init__(self) -> None:
        if self.strategy not in STRATEGIES:
            raise UsageError(f"--strategy {self.strategy!r} is not one of {', '.join(STRATEGIES)}")
        if self.tp < 1:
            raise UsageError(f"--tp-degree must be at least 1, got {self.tp}")
        if self.pp < 1:
            raise UsageError(f"--pp-degree must be at least 1, got {self.pp}")
        if self.dp == -1:
            if self.world_size % (self.tp * self.pp):
                raise UsageError(
                    f"--tp-degree {self.tp} x --pp-degree {self.pp} does not divide the world size {self.world_size}"
                    if self.pp > 1 else f"--tp-degree {self.tp} does not divide the world size {self.world_size}")
            self.dp = self.world_size // (self.tp * self.pp)
        if self.dp < 1 or self.pp * self.dp * self.tp != self.world_size:
            pp = f"--pp-degree {self.pp} x " if self.pp > 1 else ""
            raise UsageError(
                f"{pp}--dp-degree {self.dp} x --tp-degree {self.tp} = {self.pp * self.dp * self.tp}, "
                f"but the world size is {self.world_size}; make the product equal the number of ranks"
            )
        if self.ep < 1:
            raise UsageError(f"--ep-degree must be at least 1, got {self.ep}")
        if self.dp % self.ep:
            raise UsageError(f"--ep-degree {self.ep} does not divide the {self.dp} data-parallel ranks it is carved "
                             "out of; choose a divisor of the data-parallel degree")

    @property
    def dp_enabled(self) -> bool:
        return self.dp > 1

    @property
    def tp_enabled(self) -> bool:
        return self.tp > 1

    @property
    def pp_enabled(self) -> bool:
        return self.pp > 1

    @property
    def ep_enabled(self) -> bool:
        return self.ep > 1

    @property
    def ep_replicas(self) -> int:
        """Data-parallel ranks holding each expert: one per expert-parallel group."""
        return self.dp // self.ep

    @property
    def replicas_share_parameters(self) -> bool:
        """True when every data-parallel rank holds the same parameters (all but fsdp)."""
        return self.strategy != "fsdp"

    def coordinates(self, rank: int) -> tuple[int, int]:
        """(dp rank, tp rank) of a global rank: the ("pp", "dp", "tp") mesh is laid out row-major,
        so the tensor-parallel ranks of one replica are neighbours (one node, fast links)."""
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank} is outside the world of {self.world_size}")
        return divmod(rank % (self.dp * self.tp), self.tp)

    def pp_rank(self, rank: int) -> int:
        """The pipeline stage (of ``pp``) that a global rank runs."""
        return rank // (self.dp * self.tp)

    def build_mesh(self, device_type: str) -> DeviceMesh | None:
        """The ("dp", "tp") mesh, ("pp", "dp", "tp") with pipeline stages; None for a single
        process, which needs no process groups."""
        if self.world_size == 1:
            return None
        if self._mesh is None:
            if self.pp_enabled:
                self._mesh = init_device_mesh(device_type, (self.pp, self.dp, self.tp),
                                              mesh_dim_names=("pp", "dp", "tp"))
            else:
                self._mesh = init_device_mesh(device_type, (self.dp, self.tp), mesh_dim_names=("dp", "tp"))
        return self._mesh

    def dp_group(self, device_type: str) -> dist.ProcessGroup | None:
        mesh = self.build_mesh(device_type)
        if mesh is None:
            return None
        if not self.tp_enabled and not self.pp_enabled:
            # The world group itself: no extra gloo communicator to set up.
            return dist.group.WORLD
        return self._group(mesh, "dp")

    def pp_group(self, device_type: str) -> dist.ProcessGroup | None:
        """The ranks holding the stages of one pipeline; None without pipeline parallel."""
        if not self.pp_enabled:
            return None
        return self._group(self.build_mesh(device_type), "pp")

    def tp_group(self, device_type: str) -> dist.ProcessGroup | None:
        """The ranks holding one replica's tensor-parallel shards; None without tensor parallel."""
        if not self.tp_enabled:
            return None
        return self._group(self.build_mesh(device_type), "tp")

    def ep_mesh(self, device_type: str) -> DeviceMesh | None:
        """The ("ep_replica", "ep") mesh over this rank's data-parallel ranks (those of its
        pipeline stage and tensor-parallel place): "ep" groups ``ep`` consecutive ones
        (neighbours, as tensor parallel's are), which split the experts; "ep_replica" the
        ranks holding the same experts. None without expert parallel. Under tensor parallel
        every tensor-parallel place has experts of its own, as each sees its replica's
        whole batch (distlm/parallel/expert.py)."""
        if not self.ep_enabled:
            return None
        if self._ep_mesh is None:
            if not self.tp_enabled and not self.pp_enabled:
                self._ep_mesh = init_device_mesh(device_type, (self.ep_replicas, self.ep),
                                                 mesh_dim_names=("ep_replica", "ep"))
            else:
                mesh = self.build_mesh(device_type)
                self._ep_mesh = mesh["dp"]._unflatten(0, (self.ep_replicas, self.ep), ("ep_replica", "ep"))
        return self._ep_mesh

    def dp_peers(self, rank: int) -> list[int]:
        """The data-parallel ranks of ``rank``'s pipeline stage and tensor-parallel place,
        which see the different parts of one global batch."""
        stage, (_, tp_rank) = self.pp_rank(rank), self.coordinates(rank)
        return [other for other in range(self.world_size)
                if self.pp_rank(other) == stage and self.coordinates(other)[1] == tp_rank]

    def _group(self, mesh: DeviceMesh, name: str) -> dist.ProcessGroup:
        if name not in self._groups:
            self._groups[name] = mesh[name].get_group()
        return self._groups[name]


# Nodes, simulated (--ranks-per-node) or real, as a ("node", "local") device mesh: the
# hierarchical all-reduce reduces inside a node first.


class NodeGroups(NamedTuple):
    intra: dist.ProcessGroup
    """The ranks of this rank's node."""
    inter: dist.ProcessGroup
    """The ranks with this rank's local rank, one per node."""


def validate_ranks_per_node(ranks_per_node: int | None, world_size: int) -> int:
    """The number of nodes; UsageError unless ``ranks_per_node`` divides the world size."""
    if ranks_per_node is None:
        raise UsageError("--comm-hook hierarchical needs --ranks-per-node (the number of ranks on each node)")
    if ranks_per_node < 1 or world_size % ranks_per_node:
        raise UsageError(
            f"--ranks-per-node {ranks_per_node} does not divide the world size {world_size}; "
            "give the number of ranks on each node (every node must run as many)"
        )
    return world_size // ranks_per_node


def node_groups(ranks_per_node: int, world_size: int, device_type: str = "cpu") -> NodeGroups:
    """Intra- and inter-node groups of consecutive nodes of ``ranks_per_node`` ranks each
    (``--ranks-per-node``, which simulates nodes). Called on every rank."""
    num_nodes = validate_ranks_per_node(ranks_per_node, world_size)
    return node_groups_of([rank // ranks_per_node for rank in range(world_size)], device_type, num_nodes)


def node_groups_of(node_of_rank: Sequence[int], device_type: str = "cpu", num_nodes: int | None = None) -> NodeGroups:
    """Intra- and inter-node groups from the node each rank really runs on (called on every rank).

    Nodes need not hold consecutive ranks (``mpiexec --map-by node`` places them round
    robin), but every node must hold as many: the inter-node groups pair the i-th rank
    of each node.
    """
    if len(node_of_rank) != dist.get_world_size():
        raise ValueError(f"node_groups spans all ranks: {len(node_of_rank)} != {dist.get_world_size()}")
    grid = ranks_by_node(node_of_rank)
    sizes = sorted({len(ranks) for ranks in grid})
    if len(sizes) != 1:
        counts = ", ".join(f"node {i}: {len(ranks)}" for i, ranks in enumerate(grid))
        raise UsageError(
            f"--comm-hook hierarchical needs the same number of ranks on every node, found {counts}; "
            "start as many ranks on each node"
        )
    if num_nodes is not None and len(grid) != num_nodes:
        raise ValueError(f"expected {num_nodes} nodes, found {len(grid)}")
    mesh = DeviceMesh(device_type, torch.tensor(grid), mesh_dim_names=("node", "local"))
    return NodeGroups(intra=mesh["local"].get_group(), inter=mesh["node"].get_group())
