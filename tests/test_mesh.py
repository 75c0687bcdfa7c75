"""ParallelDims: degrees, validation and named meshes, from 64 fake ranks to 2 and 4 real ones."""

from __future__ import annotations

import pytest
import torch.distributed as dist
from torch.testing._internal.distributed.fake_pg import FakeStore

from distributed import Scenarios
from distlm.errors import UsageError
from distlm.mesh import ParallelDims


@pytest.mark.parametrize(
    "world, dp, tp, expected",
    [(64, -1, 8, (8, 8)), (64, 16, 4, (16, 4)), (8, -1, 1, (8, 1)), (1, -1, 1, (1, 1))],
)
def test_degrees(world, dp, tp, expected):
    dims = ParallelDims(world_size=world, dp=dp, tp=tp)
    assert (dims.dp, dims.tp) == expected
    assert dims.dp_enabled == (expected[0] > 1) and dims.tp_enabled == (expected[1] > 1)


@pytest.mark.parametrize(
    "world, dp, tp, flag",
    [(64, -1, 6, "--tp-degree 6"), (64, 4, 8, "--dp-degree 4"), (8, -1, 0, "--tp-degree")],
)
def test_degrees_that_do_not_fit_are_refused(world, dp, tp, flag):
    with pytest.raises(UsageError, match=flag):
        ParallelDims(world_size=world, dp=dp, tp=tp)


def test_an_unknown_strategy_is_refused():
    with pytest.raises(UsageError, match="--strategy 'zero3'"):
        ParallelDims(world_size=8, strategy="zero3")
    assert not ParallelDims(world_size=8, strategy="fsdp").replicas_share_parameters
    assert ParallelDims(world_size=8, strategy="zero1").replicas_share_parameters


def test_meshes_of_64_ranks_with_the_fake_process_group():
    """Shapes and group membership at 64 ranks, without 64 processes."""
    store = FakeStore()
    for rank in (0, 13, 63):
        dist.init_process_group("fake", store=store, rank=rank, world_size=64)
        try:
            dims = ParallelDims(world_size=64, tp=8)
            mesh = dims.build_mesh("cpu")
            assert mesh.mesh_dim_names == ("dp", "tp") and tuple(mesh.shape) == (8, 8)
            # Row-major layout: the tp group is 8 consecutive ranks, the dp group a stride of 8.
            assert dist.get_process_group_ranks(mesh["tp"].get_group()) == list(range(rank // 8 * 8, rank // 8 * 8 + 8))
            assert dist.get_process_group_ranks(dims.dp_group("cpu")) == list(range(rank % 8, 64, 8))
        finally:
            dist.destroy_process_group()


def groups_on_real_ranks(tp: int) -> dict:
    import datetime
    import os

    from distlm.backends.cpu import CpuBackend
    from distlm.launch.detect import detect_launch

    env = detect_launch()
    dims = ParallelDims(world_size=int(os.environ["WORLD_SIZE"]), tp=tp)
    if not dist.is_initialized():  # the job's first scenario; the next ones build their meshes on it
        CpuBackend().init_process_group(env, datetime.timedelta(seconds=60))
    mesh = dims.build_mesh("cpu")
    tp_group = dims.tp_group("cpu")
    return {
        "dp": dist.get_process_group_ranks(dims.dp_group("cpu")),
        "tp": dist.get_process_group_ranks(tp_group) if tp_group is not None else None,
        # ParallelDims' own arithmetic agrees with the mesh torch built.
        "coordinates": dims.coordinates(env.rank) == (mesh["dp"].get_local_rank(), mesh["tp"].get_local_rank()),
    }


REAL_MESHES = {
    "2-ranks-dp2": (2, 1, [([0, 1], None), ([0, 1], None)]),
    "2-ranks-tp2": (2, 2, [([0], [0, 1]), ([1], [0, 1])]),
    "4-ranks-dp2-tp2": (4, 2, [([0, 2], [0, 1]), ([1, 3], [0, 1]), ([0, 2], [2, 3]), ([1, 3], [2, 3])]),
}


@pytest.fixture(scope="module")
def real_meshes() -> dict[int, Scenarios]:
    """The meshes built on real gloo ranks, one job per world size."""
    return {world: Scenarios(world, [(case, groups_on_real_ranks, (tp,)) for case, (w, tp, _) in REAL_MESHES.items()
                                     if w == world], timeout=120)
            for world in sorted({w for w, _, _ in REAL_MESHES.values()})}


@pytest.mark.parametrize("case", REAL_MESHES)
def test_meshes_on_real_gloo_ranks(case, real_meshes):
    world, _, expected = REAL_MESHES[case]
    groups = real_meshes[world][case]
    assert [(g["dp"], g["tp"]) for g in groups] == expected
    assert all(g["coordinates"] for g in groups)


def test_pipeline_axis_is_outermost_with_the_fake_process_group():
    """pp x dp x tp = 4 x 2 x 8 at 64 ranks: a stage is 16 consecutive ranks, its pipeline
    peers a stride of 16 apart, and the coordinates agree with the mesh."""
    store = FakeStore()
    for rank in (0, 21, 63):
        dist.init_process_group("fake", store=store, rank=rank, world_size=64)
        try:
            dims = ParallelDims(world_size=64, tp=8, pp=4)
            mesh = dims.build_mesh("cpu")
            assert mesh.mesh_dim_names == ("pp", "dp", "tp") and tuple(mesh.shape) == (4, 2, 8) and dims.dp == 2
            assert dist.get_process_group_ranks(dims.pp_group("cpu")) == list(range(rank % 16, 64, 16))
            assert dist.get_process_group_ranks(dims.dp_group("cpu")) == [rank // 16 * 16 + rank % 8 + 8 * i
                                                                          for i in range(2)]
            assert dims.pp_rank(rank) == mesh["pp"].get_local_rank() == rank // 16
            assert dims.coordinates(rank) == (mesh["dp"].get_local_rank(), mesh["tp"].get_local_rank())
        finally:
            dist.destroy_process_group()


def test_pipeline_degree_must_divide_the_world():
    with pytest.raises(UsageError, match="--pp-degree 3 x --dp-degree 1 x --tp-degree 2 = 6, but the world size is 4"):
        ParallelDims(world_size=4, dp=1, tp=2, pp=3)
    with pytest.raises(UsageError, match="--tp-degree 2 x --pp-degree 3 does not divide the world size 4"):
        ParallelDims(world_size=4, tp=2, pp=3)
