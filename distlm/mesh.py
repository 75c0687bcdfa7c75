"""ParallelDims: the one owner of the topology (strategy, degrees, their validation, named meshes).

A degree of 1 means that form of parallelism is off. The data-parallel degree is
whatever the other degrees leave of the world size. Meshes and groups are fetched by
name, and a rank's coordinates come from here, so strategies never compute rank
arithmetic of their own.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from distlm.choices import STRATEGIES
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
    _mesh: DeviceMesh | None = field(default=None, init=False, repr=False)
    _groups: dict[str, dist.ProcessGroup] = field(default_factory=dict, init=False, repr=False)
    """Each mesh dimension's group, sliced once: a slice builds a new DeviceMesh every time."""

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

    def _group(self, mesh: DeviceMesh, name: str) -> dist.ProcessGroup:
        if name not in self._groups:
            self._groups[name] = mesh[name].get_group()
        return self._groups[name]
