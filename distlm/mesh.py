"""ParallelDims: the one owner of the topology (strategy, degrees, nodes, their validation, named meshes).

A degree of 1 means that form of parallelism is off. The data-parallel degree is
whatever the other degrees leave of the world size. Meshes and groups are fetched by
name, and a rank's coordinates and node come from here, so strategies never compute rank
arithmetic of their own.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import NamedTuple, Sequence

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from distlm.choices import STRATEGIES
from distlm.errors import UsageError
from distlm.launch.hosts import ranks_by_node
from distlm.layout import Layout, simulated_node_of_rank


@dataclass
class ParallelDims:
    """The degrees of a run over ``world_size`` ranks and the nodes they run on; validated once."""

    world_size: int
    dp: int = Layout.dp_degree
    tp: int = Layout.tp_degree
    pp: int = Layout.pp_degree
    """Pipeline stages: the outermost mesh axis (pp, dp, tp), so a stage's dp x tp ranks are neighbours."""
    strategy: str = Layout.strategy
    """How the data-parallel axis holds the model: ddp (replicas), zero1 (replicas,
    sharded optimizer state) or fsdp (everything sharded)."""
    ep: int = Layout.ep_degree
    """Expert parallel: groups of ``ep`` consecutive data-parallel ranks split each MoE layer's
    experts; the ranks at one place in their groups (``ep_replicas`` of them) hold the same experts."""
    ranks_per_node: int | None = Layout.ranks_per_node
    """The node axis simulated: nodes of this many consecutive ranks (``--ranks-per-node``);
    None: the real nodes, ``node_of_rank``."""
    node_of_rank: tuple[int, ...] | None = None
    """The node axis: the node each rank really runs on, numbered by each node's lowest rank. The
    start-up fills it from the hosts it gathers (``on_nodes``); None before, or in dims built by hand."""
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

    @classmethod
    def from_layout(cls, layout: Layout, world_size: int) -> ParallelDims:
        """``layout``'s strategy, degrees and simulated nodes over ``world_size`` ranks, validated."""
        return cls(world_size=world_size, dp=layout.dp_degree, tp=layout.tp_degree, pp=layout.pp_degree,
                   strategy=layout.strategy, ep=layout.ep_degree, ranks_per_node=layout.ranks_per_node)

    def on_nodes(self, node_of_rank: Sequence[int]) -> ParallelDims:
        """These dims with the node each rank really runs on (found at start, before any mesh)."""
        return dataclasses.replace(self, node_of_rank=tuple(node_of_rank))

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

    def node_grid(self) -> list[list[int]]:
        """The ranks of each node, node by node, each ascending: the (nodes, ranks per node) grid
        of a hierarchical all-reduce. Simulated nodes of ``ranks_per_node`` consecutive ranks
        when it is given, else the real ones. UsageError where ``ranks_per_node`` does not divide
        the world, where no node is known, or where nodes run different numbers of ranks.

        Real nodes need not hold consecutive ranks (``mpiexec --map-by node`` places them round
        robin), but every node must hold as many: the inter-node groups pair the i-th rank of
        each node."""
        if self.ranks_per_node is not None or self.node_of_rank is None:
            node_of_rank = simulated_node_of_rank(self.ranks_per_node, self.world_size)
        else:
            node_of_rank = self.node_of_rank
        grid = ranks_by_node(node_of_rank)
        if len({len(ranks) for ranks in grid}) != 1:
            counts = ", ".join(f"node {i}: {len(ranks)}" for i, ranks in enumerate(grid))
            raise UsageError(
                f"--comm-hook hierarchical needs the same number of ranks on every node, found {counts}; "
                "start as many ranks on each node"
            )
        return grid

    def node_groups(self, device_type: str) -> NodeGroups:
        """Intra- and inter-node groups of ``node_grid`` as a ("node", "local") device mesh; called
        on every rank together."""
        grid = self.node_grid()
        if self.world_size != dist.get_world_size():
            raise ValueError(f"node groups span all ranks: {self.world_size} != {dist.get_world_size()}")
        mesh = DeviceMesh(device_type, torch.tensor(grid), mesh_dim_names=("node", "local"))
        return NodeGroups(intra=mesh["local"].get_group(), inter=mesh["node"].get_group())

    def _group(self, mesh: DeviceMesh, name: str) -> dist.ProcessGroup:
        if name not in self._groups:
            self._groups[name] = mesh[name].get_group()
        return self._groups[name]


class NodeGroups(NamedTuple):
    """The two process groups of a hierarchical all-reduce, seen from one rank."""

    intra: dist.ProcessGroup
    """The ranks of this rank's node."""
    inter: dist.ProcessGroup
    """The ranks with this rank's local rank, one per node."""
