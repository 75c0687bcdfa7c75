"""torchrun (torch.distributed.run), or anything exporting the same variables."""

from __future__ import annotations

from typing import Mapping

from distlm.errors import UsageError
from distlm.launch.cluster_env import (
    ClusterEnv,
    ceil_div,
    check_at_most,
    check_below,
    read_int,
    read_optional_int,
    read_port,
)


class TorchElasticLauncher:
    """torchrun / torch.distributed.run, or anything exporting the same variables."""

    RANK_VAR = "RANK"
    WORLD_VARS = ("WORLD_SIZE",)

    @staticmethod
    def detect(environ: Mapping[str, str]) -> ClusterEnv | None:
        full_set = all(name in environ for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR"))
        if "TORCHELASTIC_RUN_ID" not in environ and not full_set:
            return None
        world_size = read_int(environ, "WORLD_SIZE", minimum=1)
        rank = read_int(environ, "RANK")
        check_below(rank, "RANK", world_size, "WORLD_SIZE")
        local_world_size = read_int(environ, "LOCAL_WORLD_SIZE", minimum=1)
        check_at_most(local_world_size, "LOCAL_WORLD_SIZE", world_size, "WORLD_SIZE")
        local_rank = read_int(environ, "LOCAL_RANK")
        check_below(local_rank, "LOCAL_RANK", local_world_size, "LOCAL_WORLD_SIZE")
        # torchrun exports the agent (= node) index and count; plain exports may not.
        num_nodes = read_optional_int(environ, "GROUP_WORLD_SIZE", minimum=1)
        num_nodes = num_nodes if num_nodes is not None else ceil_div(world_size, local_world_size)
        node_rank = read_optional_int(environ, "GROUP_RANK")
        nodes_assumed = None
        if node_rank is None:
            node_rank = rank // local_world_size
            if local_world_size < world_size:
                nodes_assumed = "GROUP_RANK is not set; export each node's index as GROUP_RANK, as torchrun does"
        check_below(node_rank, "node rank (GROUP_RANK, or RANK // LOCAL_WORLD_SIZE)", num_nodes, "node count")
        if not environ.get("MASTER_ADDR"):
            raise UsageError("MASTER_ADDR is not set; torchrun sets it, a manual launch must export it")
        if "MASTER_PORT" not in environ:
            raise UsageError("MASTER_PORT is not set; torchrun sets it, a manual launch must export it")
        return ClusterEnv(
            rank=rank,
            world_size=world_size,
            local_rank=local_rank,
            local_world_size=local_world_size,
            node_rank=node_rank,
            num_nodes=num_nodes,
            master_addr=environ["MASTER_ADDR"],
            master_port=read_port(environ, "MASTER_PORT"),
            launcher="torchelastic",
            nodes_assumed=nodes_assumed,
        )
