"""Communication hooks (distlm.parallel.comm_hooks) on real gloo processes.

Two spawned jobs carry every distributed check, since spawning is the expensive part on
two cores: one of 2 ranks (reducers, fp16 overflow, DDP end to end, double buffering)
and one of 4 ranks as 2 simulated nodes of 2 (hierarchical). Each job computes its
references itself (plain ``dist.all_reduce`` and divide, a no-hook DDP run) and returns
numbers; the assertions and the bounds live here in the parent.

Error bounds. For one element let the ranks hold x_1..x_n, S = sum_i |x_i| / n and
u = unit roundoff (2**-24 fp32, 2**-11 fp16, 2**-8 bf16; eps = 2u). A sum of n terms
takes n - 1 rounded additions whose partial sums are bounded by sum |terms|, whatever
order the algorithm adds them in; dividing by n = 2 or 4 is exact. Hence:

* fp32 result vs the fp32 reference: each is within (n-1) u32 * n S of the exact sum, so
  they differ by at most 2 (n-1) u32 S after dividing by n (only the order differs).
* half precision, k terms summed in half (k = n for fp16/bf16; k = nodes for the
  hierarchical inter-node leg): k roundings of the inputs (each <= u |input|) plus
  k - 1 additions, all bounded by S: k u S (1 + u). Inputs below the smallest normal
  round to a grid of tiny * eps instead, adding k * tiny * u (2**-25 each in fp16).
  Since S <= max|x| this is at most (k / 2) * eps_half * max|x| (+ the fp32 terms):
  1 * eps_half * max|x| for 2 ranks.
"""

from __future__ import annotations

import datetime

import pytest
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from distributed import run_distributed
from distlm.mesh import ParallelDims
from distlm.errors import UsageError
from distlm.parallel import comm_hooks as ch
from distlm.parallel import ddp

SIZES = (1, 7, 64, 1001)  # 1, 7 and 1001 are not multiples of the node size 2
U32 = 2.0**-24
STEPS, LR = 3, 0.1


def _init() -> tuple[int, int]:
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
    return dist.get_rank(), dist.get_world_size()


def _init_done() -> tuple[int, int]:
    return dist.get_rank(), dist.get_world_size()


def _rank_data(size: int, rank: int, seed: int) -> torch.Tensor:
    """Deterministic per-rank data over 10 decades of magnitude (|x| < ~5e4 < 65504)."""
    g = torch.Generator().manual_seed(1000 * seed + 17 * size + rank)
    scale = 10.0 ** (torch.rand(size, generator=g) * 10 - 6)
    return torch.randn(size, generator=g) * scale


def _nodes(ranks_per_node: int | None) -> ParallelDims:
    """This job's ranks on simulated nodes of ``ranks_per_node`` consecutive ranks (--ranks-per-node)."""
    return ParallelDims(world_size=dist.get_world_size(), ranks_per_node=ranks_per_node)


def _plain_mean(x: torch.Tensor) -> torch.Tensor:
    out = x.clone()
    dist.all_reduce(out)
    return out / dist.get_world_size()


def _reducer_cases(kinds: list[tuple[str, str, int | None]], seed: int) -> list[dict]:
    """Each reducer against plain all-reduce + divide on the same per-rank data."""
    rank, _ = _init_done()
    cases = []
    for label, kind, ranks_per_node in kinds:
        reducer = ch.build_reducer(kind, None, dims=_nodes(ranks_per_node), device_type="cpu")
        for size in SIZES:
            x = _rank_data(size, rank, seed)
            flat = x.clone()
            result = reducer(flat).wait()
            abs_mean = _plain_mean(x.abs())
            max_abs = x.abs().max().clone()
            dist.all_reduce(max_abs, op=dist.ReduceOp.MAX)
            cases.append(
                dict(label=label, kind=kind, size=size, result=result.clone(), reference=_plain_mean(x),
                     abs_mean=abs_mean, max_abs=float(max_abs), reused=result.data_ptr() == flat.data_ptr())
            )
    return cases


# --------------------------------------------------------------------------- DDP helpers


def _mlp() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Linear(8, 32), torch.nn.Tanh(), torch.nn.Linear(32, 32), torch.nn.Tanh(), torch.nn.Linear(32, 4)
    )


def _batch(step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 * step + rank)
    return torch.randn(6, 8, generator=g), torch.randn(6, 4, generator=g)


def _loss(model: torch.nn.Module, step: int, rank: int) -> torch.Tensor:
    x, y = _batch(step, rank)
    return torch.nn.functional.mse_loss(model(x), y)


def _ddp(hook=None, state=None):
    # ~210 bytes: 1476 parameters in 1 bucket at step 1, in 3 after DDP rebuilds them by ready order.
    model = DistributedDataParallel(_mlp(), bucket_cap_mb=0.0002, gradient_as_bucket_view=True)
    buckets: list[set[tuple[int, int]]] = []  # per step: (bucket index, numel)
    if hook is not None:
        def recording_hook(s, bucket):
            buckets[-1].add((bucket.index(), bucket.buffer().numel()))
            return hook(s, bucket)

        model.register_comm_hook(state, recording_hook)
    return model, buckets


def _train_ddp(hook=None) -> dict:
    rank, _ = _init_done()
    model, buckets = _ddp(hook)
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    for step in range(STEPS):
        buckets.append(set())
        opt.zero_grad()
        _loss(model, step, rank).backward()
        opt.step()
    params = {n: p.detach().clone() for n, p in model.module.named_parameters()}
    return dict(params=params, buckets=[len(b) for b in buckets])


def _local_grad_max() -> float:
    """max |local gradient| over ranks, steps and parameters along the no-hook trajectory."""
    rank, n = _init_done()
    model = _mlp()
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    worst = torch.zeros(())
    for step in range(STEPS):
        opt.zero_grad()
        _loss(model, step, rank).backward()
        for p in model.parameters():
            worst = torch.maximum(worst, p.grad.abs().max())
            dist.all_reduce(p.grad)
            p.grad /= n
        opt.step()
    dist.all_reduce(worst, op=dist.ReduceOp.MAX)
    return float(worst)


def _ddp_end_to_end(kinds: list[tuple[str, str, int | None]]) -> dict:
    results = {"none": _train_ddp(), "grad_max": _local_grad_max()}
    for label, kind, ranks_per_node in kinds:
        reducer = ch.build_reducer(kind, None, dims=_nodes(ranks_per_node), device_type="cpu")
        results[label] = _train_ddp(ddp.ddp_hook(reducer))
    return results


# ------------------------------------------------------------------- double buffering


def _double_buffering_closed_form() -> dict:
    """Linear without bias, loss = sum(w * x): the gradient is exactly x."""
    rank, n = _init_done()
    torch.manual_seed(0)
    module = torch.nn.Linear(5, 1, bias=False)
    with torch.no_grad():
        module.weight.copy_(torch.tensor([[3.0, -2.0, 0.0, 1.0, 7.0]]))
    model = DistributedDataParallel(module, gradient_as_bucket_view=True)
    hook, state = ddp.double_buffered_hook(ch.build_reducer("allreduce", None, device_type="cpu"))
    model.register_comm_hook(state, hook)
    opt = torch.optim.SGD(model.parameters(), lr=0.25)
    weights, grads, first_steps, stale = [module.weight.detach().clone()], [], [], []
    for step in range(5):
        # small integers: means are multiples of 1/2, updates of 1/8, all exact in fp32
        x = torch.randint(-4, 5, (1, 5), generator=torch.Generator().manual_seed(10 * step + rank)).float()
        opt.zero_grad()
        model(x).sum().backward()
        grads.append(module.weight.grad.detach().clone())
        first_steps.append(state.first_step)
        stale.append(state.has_stale_gradients())
        if not state.first_step:
            opt.step()
        weights.append(module.weight.detach().clone())
    state.wait_pending()
    return dict(weights=weights, grads=grads, first_steps=first_steps, stale=stale, world_size=n)


def _double_buffering_mlp() -> dict:
    """Several buckets, which DDP rebuilds after step 1, against a hand-made stale-SGD reference."""
    rank, n = _init_done()
    hook, state = ddp.double_buffered_hook(ch.build_reducer("allreduce", None, device_type="cpu"))
    model, buckets = _ddp(hook, state)
    opt = torch.optim.SGD(model.parameters(), lr=LR)

    reference = _mlp()
    ref_opt = torch.optim.SGD(reference.parameters(), lr=LR)
    previous = None
    params_per_step, reference_per_step = [], []
    for step in range(STEPS + 1):
        buckets.append(set())
        opt.zero_grad()
        _loss(model, step, rank).backward()
        if not state.first_step:
            opt.step()
        # reference: this step's mean gradient is computed now and applied at the next step
        ref_opt.zero_grad()
        _loss(reference, step, rank).backward()
        current = []
        for p in reference.parameters():
            g = p.grad.clone()
            dist.all_reduce(g)
            current.append(g / n)
        if previous is not None:
            for p, g in zip(reference.parameters(), previous):
                p.grad.copy_(g)
            ref_opt.step()
        previous = current
        params_per_step.append([p.detach().clone() for p in model.module.parameters()])
        reference_per_step.append([p.detach().clone() for p in reference.parameters()])
    state.wait_pending()
    return dict(params=params_per_step, reference=reference_per_step, buckets=[sorted(b) for b in buckets])


# ------------------------------------------------------------------------- the jobs


def _fp16_overflow() -> dict:
    """60000 on each of 2 ranks: a naive fp16 sum is 120000 = inf; ours never forms it."""
    x = torch.tensor([60000.0, -60000.0, 65504.0, 1.0])
    naive = x.half()
    dist.all_reduce(naive)
    ours = ch.build_reducer("fp16", None, device_type="cpu")(x.clone()).wait()
    return dict(naive=naive.float() / 2, ours=ours, reference=_plain_mean(x))


def _exact_half() -> dict:
    """Integers: every x/2 and every partial sum is representable in fp16 and bf16."""
    rank, _ = _init_done()
    x = torch.randint(-100, 101, (257,), generator=torch.Generator().manual_seed(rank)).float()
    out = {}
    for kind in ("fp16", "bf16"):
        out[kind] = ch.build_reducer(kind, None, device_type="cpu")(x.clone()).wait()
    out["reference"] = _plain_mean(x)
    return out


def _usage_errors_in_job() -> list[str]:
    messages = []
    for kind, ranks_per_node in (("hierarchical", 3), ("hierarchical-fp16", None), ("ring", 1)):
        try:
            ch.build_reducer(kind, None, dims=_nodes(ranks_per_node), device_type="cpu")
        except UsageError as exc:
            messages.append(str(exc))
    return messages


def _two_rank_job() -> dict:
    _init()
    kinds = [
        ("allreduce", "allreduce", None),
        ("fp16", "fp16", None),
        ("bf16", "bf16", None),
        ("hierarchical 1x2", "hierarchical", 2),  # one node: the inter-node leg is skipped
        ("hierarchical 2x1", "hierarchical", 1),  # one rank per node: the intra-node legs are skipped
        ("hierarchical-fp16 2x1", "hierarchical-fp16", 1),
    ]
    return dict(
        reducers=_reducer_cases(kinds, seed=1),
        overflow=_fp16_overflow(),
        exact=_exact_half(),
        ddp=_ddp_end_to_end(kinds),
        double=_double_buffering_closed_form(),
        double_mlp=_double_buffering_mlp(),
        usage_errors=_usage_errors_in_job(),
    )


def _four_rank_job() -> dict:
    _init()
    groups = ParallelDims(world_size=4, ranks_per_node=2).node_groups("cpu")
    kinds = [
        ("hierarchical 2x2", "hierarchical", 2),
        ("hierarchical-fp16 2x2", "hierarchical-fp16", 2),
        ("hierarchical 1x4", "hierarchical", 4),
        ("hierarchical 4x1", "hierarchical", 1),
        ("fp16", "fp16", None),
    ]
    return dict(
        intra=dist.get_process_group_ranks(groups.intra),
        inter=dist.get_process_group_ranks(groups.inter),
        reducers=_reducer_cases(kinds, seed=2),
        ddp=_ddp_end_to_end(kinds[:2]),
    )


@pytest.fixture(scope="module")
def two_ranks() -> list[dict]:
    return run_distributed(_two_rank_job, 2, timeout=180)


@pytest.fixture(scope="module")
def four_ranks() -> list[dict]:
    return run_distributed(_four_rank_job, 4, timeout=180)


# --------------------------------------------------------------------------- bounds


def _half_terms(label: str, n: int) -> tuple[torch.dtype | None, int]:
    """(half dtype, number of terms summed in it) of a reducer case."""
    if label.startswith("fp16"):
        return torch.float16, n
    if label.startswith("bf16"):
        return torch.bfloat16, n
    if label.startswith("hierarchical-fp16"):
        nodes = int(label.split()[1].split("x")[0])
        return torch.float16, nodes
    return None, 0


def _bound(abs_mean: torch.Tensor, n: int, dtype: torch.dtype | None, k: int) -> torch.Tensor:
    """Per element: 2 (n-1) u32 S for the fp32 summation order, plus k u S (1+u) + k tiny u in half."""
    bound = 2 * (n - 1) * U32 * abs_mean * (1 + 1e-6) + 1e-38
    if dtype is not None:
        info = torch.finfo(dtype)
        u = info.eps / 2
        bound = bound + k * u * abs_mean * (1 + u) + k * info.smallest_normal * u
    return bound


def _check_reducers(results: list[dict]) -> dict[str, float]:
    n = len(results)
    worst: dict[str, float] = {}
    for rank_results in results:
        for case in rank_results:
            result, reference = case["result"], case["reference"]
            assert result.shape == reference.shape and result.dtype == torch.float32
            assert case["reused"], f"{case['label']}: the mean is not written into the input buffer"
            dtype, k = _half_terms(case["label"], n)
            error = (result - reference).abs()
            bound = _bound(case["abs_mean"], n, dtype, k)
            assert bool((error <= bound).all()), (
                f"{case['label']} size {case['size']}: error {float(error.max()):.3g} above its bound "
                f"at {int((error > bound).sum())} elements"
            )
            if dtype is not None:  # the coarse form of the same bound: (k/2) eps_half max|x|
                info = torch.finfo(dtype)
                coarse = (k / 2) * info.eps * case["max_abs"] * 1.001 + k * info.smallest_normal * info.eps / 2
                assert float(error.max()) <= coarse, case["label"]
            ratio = float((error / bound).max())
            worst[case["label"]] = max(worst.get(case["label"], 0.0), ratio)
    # every rank ends with the same mean
    for other in results[1:]:
        for a, b in zip(results[0], other):
            assert torch.equal(a["result"], b["result"]), a["label"]
    return worst


# ---------------------------------------------------------------------------- tests


def test_two_rank_reducers_match_plain_allreduce(two_ranks):
    worst = _check_reducers([r["reducers"] for r in two_ranks])
    # with 2 ranks the order of one addition cannot differ: the fp32 paths are bit-exact
    for case in two_ranks[0]["reducers"]:
        if case["label"] in ("allreduce", "hierarchical 1x2", "hierarchical 2x1"):
            assert torch.equal(case["result"], case["reference"]), case["label"]
    print("worst error / bound:", worst)


def test_fp16_divides_before_summing_so_no_overflow(two_ranks):
    overflow = two_ranks[0]["overflow"]
    assert torch.isinf(overflow["naive"][:3]).all()  # sum-then-divide in fp16 overflows
    assert torch.equal(overflow["ours"], overflow["reference"])  # 60000, -60000, 65504, 1 exactly


def test_half_precision_exact_where_representable(two_ranks):
    exact = two_ranks[0]["exact"]
    assert torch.equal(exact["fp16"], exact["reference"])
    assert torch.equal(exact["bf16"], exact["reference"])


def test_ddp_hooks_end_to_end(two_ranks):
    _check_ddp([r["ddp"] for r in two_ranks], expect_bit_exact=("allreduce", "hierarchical 1x2", "hierarchical 2x1"))


def _check_ddp(results: list[dict], expect_bit_exact: tuple[str, ...] = ()) -> None:
    n = len(results)
    reference = results[0]["none"]["params"]
    grad_max = results[0]["grad_max"]
    max_param = max(float(p.abs().max()) for p in reference.values())
    for label in results[0]:
        if label in ("none", "grad_max"):
            continue
        run = results[0][label]
        assert min(run["buckets"][1:]) >= 2, f"{label}: expected several buckets, saw {run['buckets']}"
        # replicas identical
        for other in results[1:]:
            for name, value in run["params"].items():
                assert torch.equal(value, other[label]["params"][name]), f"{label} {name}"
        # Each step's mean gradient is within the reducer bound with S <= grad_max; SGD moves
        # the parameters by lr times that per step, plus one fp32 rounding of each update,
        # and x2 for the second-order change of the gradient at slightly different weights.
        dtype, k = _half_terms(label, n)
        grad_bound = float(_bound(torch.tensor(grad_max), n, dtype, k))
        tol = 2 * STEPS * (LR * grad_bound + 2 * U32 * max_param)
        for name, value in run["params"].items():
            error = float((value - reference[name]).abs().max())
            assert error <= tol, f"{label} {name}: {error:.3g} > {tol:.3g}"
            if label in expect_bit_exact:
                assert torch.equal(value, reference[name]), f"{label} {name}"


def test_double_buffering_applies_the_previous_steps_gradient(two_ranks):
    """After step 1 nothing moves; after step t, w = w0 - lr * sum_{s<t} mean_rank(x_s)."""
    n = two_ranks[0]["double"]["world_size"]
    xs = [
        sum(
            torch.randint(-4, 5, (1, 5), generator=torch.Generator().manual_seed(10 * step + rank)).float()
            for rank in range(n)
        ) / n
        for step in range(5)
    ]
    for result in (r["double"] for r in two_ranks):
        assert result["first_steps"] == [True, False, False, False, False]
        assert result["stale"] == [False, True, True, True, True]
        assert torch.equal(result["grads"][0], torch.zeros(1, 5))  # the first step applies nothing
        assert torch.equal(result["weights"][1], result["weights"][0])
        for t in range(1, 5):
            assert torch.equal(result["grads"][t], xs[t - 1])  # step t+1 (1-based) sees step t's mean
        for t in range(1, 6):
            expected = result["weights"][0] - 0.25 * sum((xs[s] for s in range(t - 1)), torch.zeros(1, 5))
            assert torch.equal(result["weights"][t], expected), f"after step {t}"


def test_double_buffering_survives_ddp_bucket_rebuild(two_ranks):
    result = two_ranks[0]["double_mlp"]
    # DDP packs step 1 into other buckets than later steps (it rebuilds them in gradient-ready
    # order), so results kept by bucket index would land on the wrong parameters
    layouts = result["buckets"]
    assert layouts[0] != layouts[1] and len(layouts[1]) >= 2 and layouts[1:] == [layouts[1]] * STEPS, layouts
    print("bucket (index, numel) per step:", layouts)
    for step, (params, reference) in enumerate(zip(result["params"], result["reference"])):
        for p, q in zip(params, reference):
            torch.testing.assert_close(p, q, rtol=0, atol=1e-6, msg=lambda m: f"step {step}: {m}")
    for other in two_ranks[1:]:
        for p, q in zip(result["params"][-1], other["double_mlp"]["params"][-1]):
            assert torch.equal(p, q)


def test_usage_errors_inside_a_job(two_ranks):
    messages = two_ranks[0]["usage_errors"]
    assert len(messages) == 3
    assert "--ranks-per-node 3" in messages[0] and "world size 2" in messages[0]
    assert "--ranks-per-node" in messages[1]
    assert "'ring'" in messages[2]


def test_hierarchical_two_nodes_of_two(four_ranks):
    assert [r["intra"] for r in four_ranks] == [[0, 1], [0, 1], [2, 3], [2, 3]]
    assert [r["inter"] for r in four_ranks] == [[0, 2], [1, 3], [0, 2], [1, 3]]
    worst = _check_reducers([r["reducers"] for r in four_ranks])
    print("worst error / bound:", worst)
    _check_ddp([r["ddp"] for r in four_ranks])


def test_unknown_kind_is_a_usage_error():
    with pytest.raises(UsageError, match="--comm-hook 'ring'.*allreduce, fp16, bf16, hierarchical"):
        ch.build_reducer("ring", None, device_type="cpu")


@pytest.mark.parametrize("ranks_per_node", [0, 3, 5, None])
def test_bad_ranks_per_node_is_a_usage_error(ranks_per_node):
    with pytest.raises(UsageError, match="--ranks-per-node"):
        ParallelDims(world_size=4, ranks_per_node=ranks_per_node).node_grid()


def test_good_ranks_per_node_gives_the_node_count():
    assert len(ParallelDims(world_size=4, ranks_per_node=2).node_grid()) == 2
    assert len(ParallelDims(world_size=4, ranks_per_node=4).node_grid()) == 1
    assert len(ParallelDims(world_size=4, ranks_per_node=1).node_grid()) == 4
