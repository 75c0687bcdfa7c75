"""The scaling suite (``python -m distlm.bench scaling``): a real sweep of roberta_tiny over
1 and 2 ranks under ddp and fsdp, and at 2 ranks in two pipeline stages, its files against
the schema documented in benchmarks/README.md and against the planner that reads them and
predicts every point; the compute reference really without gradient communication; the
in-place mode under torchrun; bad input."""

from __future__ import annotations

import contextlib
import json
import math
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from distributed import run_distributed
from distlm.bench import results, scaling
from distlm.bench.__main__ import main as bench_main
from distlm.data.dictionary import Dictionary
from distlm.errors import UsageError
from distlm.models import build_model
from distlm.plan.calibrate import calibrate, fit_line, read_measurements
from distlm.config import DataConfig
from distlm.models.flops import count_parameters, flops_per_token, model_shape, parameter_groups
from distlm.layout import Layout, PipelineLayout
from distlm.plan.model import Placement, Workload, load_cluster, project

README = Path(__file__).resolve().parents[1] / "benchmarks" / "README.md"
# (world size, strategy, pp degree): the pp-2 launch has one replica, so it stands for both strategies.
POINTS = {(1, "ddp", 1), (1, "fsdp", 1), (2, "ddp", 1), (2, "fsdp", 1), (2, "ddp", 2), (2, "fsdp", 2)}
TOKENS, BATCH = 32, 2
PP_MICROBATCHES = 2  # distlm.train's default, twice the degree, would not divide the batch of 2
SWEEP = ["--strategy", "ddp,fsdp", "--steps", "2", "--warmup-steps", "1", "--repeats", "1", "--batch-size", str(BATCH),
         "--tokens-per-sample", str(TOKENS), "--device", "cpu", "--threads-per-rank", "1"]
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
TIMEOUT = 240


def subprocess_env() -> dict[str, str]:
    # conftest.py already removed every launcher variable from os.environ.
    return {**os.environ, "OMP_NUM_THREADS": "1"}


def documented_fields() -> list[str]:
    """Field names of the results.jsonl table in the README's scaling-suite section."""
    section = README.read_text().split("## Scaling suite", 1)[1].split("\n## ", 1)[0]
    schema = section.split("results.jsonl` fields", 1)[1]
    return re.findall(r"^\| `(\w+)` \|", schema, flags=re.MULTILINE)


def read_rows(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


@pytest.fixture(scope="module")
def sweep(data_dir, tmp_path_factory) -> Path:  # noqa: F811 - fixture
    out = tmp_path_factory.mktemp("scaling")
    proc = subprocess.run(
        [sys.executable, "-m", "distlm.bench", "scaling", "--ranks", "1,2", *SWEEP, "--allreduce-max-mib", "16",
         "--pp-degree", "1,2", "--pp-microbatches", str(PP_MICROBATCHES), "--data", data_dir, "--out", str(out)],
        capture_output=True, text=True, timeout=TIMEOUT, env=subprocess_env(),
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "[repetition 1/1, 2 ranks] fsdp" in proc.stderr  # progress while it runs
    assert "[repetition 1/1, 2 ranks, pp 2] ddp" in proc.stderr
    return out


def point(row: dict) -> tuple:
    return row["world_size"], row["strategy"], row["pp_degree"]


def test_results_have_the_documented_fields_and_add_up(sweep, data_dir):  # noqa: F811 - fixture
    rows = read_rows(sweep / "results.jsonl")
    fields = documented_fields()
    assert len(fields) > 30
    assert {point(row) for row in rows} == POINTS
    by_point = {point(row): row for row in rows}
    vocab = len(Dictionary.load(Path(data_dir) / "dict.txt")) + 1  # + <mask>
    for row in rows:
        assert sorted(row) == sorted(fields), "every field documented, every documented field written"
        # One thread per rank, 2 ranks at most: the suite's ranks use 2 cores.
        assert row["load_cores"] == 2 and row["under_load"] == (row["load_average_max"] > 2)
        for name in ("step_time_s", "compute_s", "optimizer_s", "tokens_per_s", "samples_per_s", "efficiency", "mfu",
                     "memory_bytes_per_rank", "flops_per_token", "peak_flops_per_rank", "predicted_step_time_s"):
            assert row[name] > 0, (name, row)
        assert (row["arch"], row["mode"], row["precision"]) == ("roberta_tiny", "weak", "fp32")
        assert row["vocab_size"] == vocab
        assert (row["batch_size"], row["update_freq"], row["tokens_per_sample"]) == (BATCH, 1, TOKENS)
        assert row["dp_degree"] == row["world_size"] // row["pp_degree"]
        assert row["global_batch_size"] == BATCH * row["dp_degree"]
        pipelined = row["pp_degree"] > 1
        assert (row["pp_schedule"], row["pp_microbatches"], row["pp_stages_per_rank"]) == (
            ("1f1b", PP_MICROBATCHES, 1) if pipelined else (None, None, None))
        parts = row["compute_s"] + row["comm_exposed_s"] + row["optimizer_s"]
        assert math.isclose(parts, row["step_time_s"], rel_tol=1e-5)
        assert math.isclose(row["tokens_per_s"], row["global_batch_size"] * TOKENS / row["step_time_s"], rel_tol=1e-5)
        base = by_point[(1, row["strategy"], 1)]  # a pipeline series too: against the plain 1-rank point
        assert row["efficiency_baseline_world_size"] == 1
        efficiency = row["tokens_per_s"] / row["world_size"] / base["tokens_per_s"]
        assert math.isclose(row["efficiency"], efficiency, rel_tol=1e-5)
        # The masked LM computes its head at the masked positions only (--mask-prob, in expectation).
        per_token = flops_per_token(model_shape("roberta_tiny", vocab), TOKENS, DataConfig().mask_prob)
        mfu = row["tokens_per_s"] * per_token / (row["peak_flops_per_rank"] * row["world_size"])
        assert math.isclose(row["mfu"], mfu, rel_tol=1e-4)
    for strategy in ("ddp", "fsdp"):
        assert by_point[(1, strategy, 1)]["efficiency"] == 1.0
        for world_size, pp_degree in ((1, 1), (2, 2)):  # one replica: nothing communicated
            assert by_point[(world_size, strategy, pp_degree)]["comm_exposed_s"] == 0.0
    # One pp-2 launch stands for both strategies: with one replica neither wraps anything.
    assert by_point[(2, "ddp", 2)]["step_time_s_repeats"] == by_point[(2, "fsdp", 2)]["step_time_s_repeats"]

    # Memory against the model itself: DDP holds 4 bytes of weights and of gradients per
    # parameter and 8 of Adam moments (plus Adam's 4-byte step counter per tensor); FSDP
    # at 2 ranks half of each (plus the padding of uneven shards); a pipeline stage holds
    # its blocks, and the tied embedding on both the first and the last.
    model = build_model("roberta_tiny", vocab_size=vocab)
    params, tensors = sum(p.numel() for p in model.parameters()), len(list(model.parameters()))
    ddp, fsdp, stage = by_point[(2, "ddp", 1)], by_point[(2, "fsdp", 1)], by_point[(2, "ddp", 2)]
    assert ddp["param_bytes"] == ddp["grad_bytes"] == 4 * params
    assert 8 * params <= ddp["optimizer_bytes"] <= 8 * params + 4 * tensors
    assert fsdp["param_bytes"] == pytest.approx(2 * params, rel=0.01)
    assert fsdp["memory_bytes_per_rank"] == pytest.approx(ddp["memory_bytes_per_rank"] / 2, rel=0.01)
    blocks = 4 * sum(p.numel() for p in model.blocks.parameters())
    assert blocks / 2 < stage["param_bytes"] < ddp["param_bytes"]
    assert stage["param_bytes"] == stage["grad_bytes"]


def test_plots_and_table_are_written(sweep):
    from matplotlib.image import imread

    for name in ("tokens_per_s.png", "efficiency.png", "step_breakdown.png"):
        path = sweep / name
        assert path.read_bytes()[:8] == PNG_SIGNATURE, name
        height, width, _ = imread(path).shape  # decodes the whole image
        assert height > 100 and width > 100, name
    table = (sweep / "results.md").read_text()
    for world_size, strategy, pp_degree in POINTS:
        label = strategy + ("" if pp_degree == 1 else f" pp{pp_degree}")
        assert re.search(rf"^\| {world_size} \| {label} \| {BATCH} x 1 \|", table, flags=re.MULTILINE), table


def test_run_json_is_written_beside_the_results(sweep, data_dir):  # noqa: F811 - fixture
    record = json.loads((sweep / "run.json").read_text())
    assert record["launch"] == {"launcher": "single", "world_size": 1, "ranks": [1, 2]}
    assert record["config"]["data"] == data_dir and record["config"]["out"] == str(sweep)
    assert {"torch", "python"} <= set(record["software"]) and record["hardware"]["cpu_cores"] == os.cpu_count()


def test_calibration_file_is_what_the_planner_fits(sweep):
    """The planner calibrated from calibration.jsonl (one-rank rows and the 2-rank all-reduce,
    nothing else) gives back the measured one-rank compute and optimizer times."""
    objects = read_rows(sweep / "calibration.jsonl")
    assert {obj.get("world_size") for obj in objects if "strategy" in obj} == {1}
    assert [obj["world_size"] for obj in objects if obj.get("benchmark") == "allreduce"] == [2]
    calibration = calibrate(read_measurements(sweep / "calibration.jsonl"))
    assert calibration.intra is not None and calibration.intra.bandwidth_Bps > 0
    cluster = calibration.apply(load_cluster("local"))
    one_rank = read_rows(sweep / "calibration.jsonl")[0]
    workload = Workload(shape=model_shape("roberta_tiny", one_rank["vocab_size"]), tokens_per_sample=TOKENS,
                        batch_size=BATCH)
    projection = project(workload, cluster, Placement(nodes=1, ranks_per_node=1))
    assert projection.compute_s == pytest.approx(one_rank["compute_s"], rel=1e-3)
    assert projection.optimizer_s == pytest.approx(one_rank["optimizer_s"], rel=1e-3)


def test_every_point_carries_the_planners_prediction(sweep):
    """Each point's predicted_step_time_s is the planner's projection of that point on this
    machine (the local profile, both ranks on this host) calibrated from calibration.jsonl:
    the pp-2 point as two stages running 2 micro-batches in 1F1B, with its bubble. The
    one-rank points are the calibration, so they give back their own update."""
    rows = read_rows(sweep / "results.jsonl")
    cluster = calibrate(read_measurements(sweep / "calibration.jsonl")).apply(load_cluster("local", ranks_per_node=2))
    shape = model_shape("roberta_tiny", rows[0]["vocab_size"])
    for row in rows:
        world_size, strategy, pp_degree = point(row)
        layout = Layout(strategy=strategy, pp_degree=pp_degree, pipeline=PipelineLayout(
            microbatches=PP_MICROBATCHES if pp_degree > 1 else PipelineLayout.microbatches))
        workload = Workload(shape=shape, layout=layout, tokens_per_sample=TOKENS, batch_size=BATCH)
        projection = project(workload, cluster, Placement(nodes=1, ranks_per_node=world_size, layout=layout))
        assert row["predicted_step_time_s"] == pytest.approx(projection.step_time_s, rel=1e-5), point(row)
        assert (projection.pp_bubble_s > 0) == (pp_degree > 1)
        if world_size == 1:
            # rel 1e-3: the planner's blocks count their norms and biases, the FLOPs per token only matmuls.
            assert row["predicted_step_time_s"] == pytest.approx(row["compute_s"] + row["optimizer_s"], rel=1e-3)
    table = (sweep / "results.md").read_text()
    assert "| predicted step (s) |" in table


def test_calibrated_prediction_of_more_ranks_is_composed_as_the_model_says(sweep):
    """The planner calibrated from calibration.jsonl predicts the 2-rank (probed) and 4-rank
    (not probed) points of ddp and fsdp from their parts, each recomputed here by hand:
    compute and optimizer are the one-rank row's, slowed as the host-sharing row of 2
    one-rank updates at once measured (2 ranks), or by ranks x threads over cores when
    they exceed them (4 ranks) (FSDP's optimizer steps a 1/N shard, pays DTensor's per-tensor dispatch measured on
    one rank, and all-reduces the gradient norm);
    communication is the fitted alpha + beta x bytes of each collective over the model's
    gradients and parameters (4 ranks: the ring formulas on the link of the 2-rank
    all-reduce, a reduce-scatter costing an all-reduce on gloo, a single number the faster of
    a ring and a tree), plus the update's all-reduce of its target-token count; FSDP adds its
    copies at the optimizer's memory bandwidth; with every core busy, nothing overlaps,
    and a collective issued while its rank still computes takes longer by the ratio of
    runnable threads (ranks x (threads + 1) against the probe's ranks) over the cores.
    No timing is asserted: only how the prediction is built."""
    objects = read_rows(sweep / "calibration.jsonl")
    one_rank = next(obj for obj in objects if obj.get("world_size") == 1 and "strategy" in obj)
    probe = next(obj for obj in objects if obj.get("benchmark") == "allreduce")
    calibration = calibrate(read_measurements(sweep / "calibration.jsonl"))
    cluster = calibration.apply(load_cluster("local", ranks_per_node=4))
    threads, cores = one_rank["threads_per_rank"], one_rank["host_cores"]
    assert (cluster.cpu_threads_per_rank, cluster.cores_per_node) == (threads, cores)
    shape = model_shape("roberta_tiny", one_rank["vocab_size"])
    groups = parameter_groups(shape)
    params = count_parameters(shape)
    root, block, n = groups.embedding + groups.head, groups.per_block, groups.blocks
    bandwidth = params * 40 / one_rank["optimizer_s"]  # AdamW + clipping: 40 bytes a parameter

    def fit(method: str) -> tuple[float, float]:
        rows = [row for row in probe["collectives"] if row["method"] == method]
        return fit_line([row["size_bytes"] for row in rows], [row["median_s"] for row in rows])

    # 2 ranks: the sweep also timed 2 one-rank updates at once; their slowdowns against the
    # one-rank row (compute: the expected slower of two) replace the cores' ratio (the
    # batches are equal in weak scaling).
    sharing = next(obj for obj in objects if obj.get("benchmark") == "host_sharing")
    assert (sharing["processes"], sharing["batch_size"], sharing["threads_per_rank"]) == (2, BATCH, threads)
    assert sharing["compute_s"] <= sharing["slowest_compute_s"]
    measured = {2: (sharing["slowest_compute_s"] / one_rank["compute_s"],
                    sharing["optimizer_s"] / one_rank["optimizer_s"])}
    for ranks in (2, 4):
        slowdown = max(1.0, ranks * threads / cores)
        slowdown, memory = measured.get(ranks, (slowdown, slowdown))
        beside = max(1.0, ranks * (threads + 1) / cores) / max(1.0, ranks / cores)
        if ranks == 2:
            costs = {method: fit(method) for method in ("plain", "all_gather", "reduce_scatter")}
            all_reduce, all_gather, reduce_scatter = (
                (lambda nbytes, a=alpha, b=beta: a + b * nbytes) for alpha, beta in costs.values()
            )
            small = all_reduce
        else:
            alpha, beta = fit("plain")
            latency, bus = alpha / 2, 1 / beta  # the 2-rank ring: 2 (p-1) steps, 2 (p-1)/p of the bytes

            def all_reduce(nbytes: float) -> float:
                return 2 * 3 * latency + 2 * 3 / 4 * nbytes / bus

            def all_gather(nbytes: float) -> float:
                return 3 * latency + 3 / 4 * nbytes / bus

            def small(nbytes: float) -> float:  # a number: the faster of the ring and a tree (2 log2 p steps)
                return min(all_reduce(nbytes), 2 * 2 * latency + 2 * nbytes / bus)

            reduce_scatter = all_reduce
        overlap = ranks * threads < cores
        for strategy in ("ddp", "fsdp"):
            workload = Workload(shape=shape, layout=Layout(strategy=strategy), tokens_per_sample=TOKENS,
                                batch_size=BATCH)
            row = project(workload, cluster, Placement(nodes=1, ranks_per_node=ranks))
            assert row.compute_slowdown == pytest.approx(slowdown, rel=1e-3)
            assert row.compute_s == pytest.approx(one_rank["compute_s"] * slowdown, rel=1e-3)
            optimizer = one_rank["optimizer_s"] * memory
            if strategy == "fsdp":
                # A 1/N shard, DTensor's dispatch for every parameter tensor (measured on one
                # rank, at least 0), and the gradient norm's all-reduce.
                dispatch = max(0.0, one_rank["dtensor_optimizer_overhead_s"]) * memory
                optimizer = optimizer / ranks + dispatch + small(4)
            assert row.optimizer_s == pytest.approx(optimizer, rel=1e-9)
            if strategy == "ddp":
                # DDP's first bucket holds 1 MiB of gradients and is all-reduced beside the
                # rest of backward; the second, the rest, once backward is done.
                comm = beside * all_reduce(2**20) + all_reduce(4 * params - 2**20)
                copies = 0.0
            else:
                # All-gathers: the root once, each block in forward and all but the last again in
                # backward; reduce-scatters: each block and the root, of fp32 gradients. All but
                # the first two all-gathers and the last two reduce-scatters are prefetched or
                # run behind the next block's backward: beside compute.
                comm = (all_gather(4 * root) + all_gather(4 * block)
                        + beside * (2 * n - 2) * all_gather(4 * block)
                        + beside * (n - 1) * reduce_scatter(4 * block)
                        + reduce_scatter(4 * block) + reduce_scatter(4 * root))
                gathered = 4 * root + (2 * n - 1) * 4 * block
                copies = (2 * gathered * (1 + 1 / ranks) + 2 * 4 * params) / bandwidth * memory
            comm += small(8)  # the global target-token count
            assert row.dp_comm_s == pytest.approx(comm, rel=1e-9), (ranks, strategy)
            assert row.fsdp_copy_s == pytest.approx(copies, rel=1e-9), (ranks, strategy)
            if overlap:
                assert row.comm_exposed_s <= comm + copies
            else:
                assert row.comm_exposed_s == pytest.approx(comm + copies, rel=1e-9), (ranks, strategy)
                assert row.step_time_s == pytest.approx(row.compute_s + row.optimizer_s + comm + copies, rel=1e-9)


def test_expected_slowest_of_several_draws():
    assert results.expected_slowest([1.0, 2.0, 3.0, 4.0], 1) == pytest.approx(2.5)  # one draw: the mean
    assert results.expected_slowest([1.0, 2.0, 3.0, 4.0], 2) == pytest.approx(50 / 16)  # sum of x P(max = x)
    assert results.expected_slowest([4.0, 1.0, 3.0, 2.0], 200) == pytest.approx(4.0)
    assert results.expected_slowest([0.3] * 5, 4) == pytest.approx(0.3)


def _communication_off_worker(data: str) -> dict:
    from distlm.bench.measure import LaunchSpec, communication_off
    from distlm.training.trainer import Trainer

    spec = LaunchSpec(arch="roberta_tiny", strategies=[], batch_size=BATCH, update_freq=1, tokens_per_sample=TOKENS,
                      precision="fp32", device="cpu", steps=1, warmup_steps=1,
                      layout=Layout(comm_hook="allreduce", tp_degree=1, bucket_cap_mb=25.0), data=data)
    counts = {"all_gather_single": 0, "reduce_scatter_single": 0}
    for name in counts:  # FSDP2's collectives, called through torch.distributed
        original = getattr(dist, name)

        def counted(*args, _original=original, _name=name, **kwargs):
            counts[_name] += 1
            return _original(*args, **kwargs)

        setattr(dist, name, counted)

    def checksum(trainer) -> list[float]:
        everyone = [None] * dist.get_world_size()
        local = [p.to_local() if isinstance(p, DTensor) else p for p in trainer.model.parameters()]
        dist.all_gather_object(everyone, float(sum(p.detach().double().sum() for p in local)))
        return everyone

    result = {}
    for strategy in ("ddp", "fsdp"):
        trainer = Trainer(spec.trainer_config(strategy))
        batches = trainer.update_batches()
        seen = {}
        for kind in ("full", "off", "full"):
            # Entering communication_off gathers FSDP's parameters once; the update itself is counted.
            with communication_off(trainer) if kind == "off" else contextlib.nullcontext():
                for name in counts:
                    counts[name] = 0
                record = trainer.train_step(next(batches))
            seen.setdefault(kind, []).append({**counts, "finite": math.isfinite(record["gnorm"]),
                                              "checksums": checksum(trainer)})
        result[strategy] = seen
    return result


def test_communication_off_runs_the_update_without_gradient_communication(data_dir):  # noqa: F811 - fixture
    ddp, fsdp = run_distributed(_communication_off_worker, 2, data_dir)[0].values()
    # DDP: replicas stay identical through a synchronised update and drift apart without one.
    first, off = ddp["full"][0]["checksums"], ddp["off"][0]["checksums"]
    assert first[0] == first[1] and off[0] != off[1]
    # FSDP: no all-gather and no reduce-scatter at all with communication off, and the
    # next synchronised update runs as usual again.
    assert fsdp["off"][0]["all_gather_single"] == fsdp["off"][0]["reduce_scatter_single"] == 0
    for update in fsdp["full"]:
        assert update["all_gather_single"] > 0 and update["reduce_scatter_single"] > 0 and update["finite"]


def test_inside_torchrun_it_measures_in_place_and_merges(sweep, data_dir, tmp_path):  # noqa: F811 - fixture
    out = tmp_path / "merged"
    shutil.copytree(sweep, out)
    before = {point(row): row for row in read_rows(out / "results.jsonl")}
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--standalone", "-m", "distlm.bench",
         "scaling", *SWEEP, "--strategy", "fsdp", "--allreduce-max-mib", "0", "--no-plots", "--data", data_dir,
         "--out", str(out)],
        capture_output=True, text=True, timeout=TIMEOUT, env=subprocess_env(),
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    after = {point(row): row for row in read_rows(out / "results.jsonl")}
    assert set(after) == POINTS
    fresh = (2, "fsdp", 1)
    assert after[fresh]["step_time_s_repeats"] != before[fresh]["step_time_s_repeats"]  # measured anew
    # Inside a launch the ranks may span a cluster the planner's local profile does not describe.
    assert after[fresh]["predicted_step_time_s"] is None
    for kept in POINTS - {fresh}:  # kept; efficiency recomputed from the rows as written (6 digits)
        assert after[kept] == {**before[kept], "efficiency": pytest.approx(before[kept]["efficiency"], rel=1e-5)}
    fsdp, base = after[fresh], after[(1, "fsdp", 1)]
    assert math.isclose(fsdp["efficiency"], fsdp["tokens_per_s"] / 2 / base["tokens_per_s"], rel_tol=1e-5)


def test_comm_hooks_and_tp_degrees_are_swept_where_distlm_runs_them(tmp_path):
    """--comm-hook and --tp-degree take lists: each tp degree at the world sizes it divides,
    comm hooks with the strategies that take one (not fsdp, not beside tensor parallel),
    and one launch for each one-replica point, which stands for all its combinations."""
    args = scaling.parse_args(["--ranks", "1,2,4", "--strategy", "ddp,fsdp", "--comm-hook", "allreduce,fp16",
                               "--tp-degree", "1,2", "--no-plots", "--out", str(tmp_path)])
    planned = scaling.plan_launches(args, [1, 2, 4])
    measured = {(launch.world_size, launch.comm_hook, launch.tp_degree, launch.strategies)
                for launch in scaling.measured_launches(planned)}
    assert measured == {
        (1, "allreduce", 1, ("ddp",)),
        (2, "allreduce", 1, ("ddp", "fsdp")), (2, "fp16", 1, ("ddp",)), (2, "allreduce", 2, ("ddp",)),
        (4, "allreduce", 1, ("ddp", "fsdp")), (4, "fp16", 1, ("ddp",)), (4, "allreduce", 2, ("ddp", "fsdp")),
    }
    assert sorted(map(tuple, scaling.combinations(planned))) == sorted([
        ("ddp", "allreduce", 1), ("fsdp", "allreduce", 1), ("ddp", "fp16", 1),
        ("ddp", "allreduce", 2), ("fsdp", "allreduce", 2),
    ])


def hand_built_launch(world_size: int, step: float, tp_degree: int = 1, pp_degree: int = 1) -> dict:
    """A launch's raw result of one ddp update of 4 samples per replica taking ``step`` seconds."""
    spec = {"batch_size": 4, "update_freq": 1, "tokens_per_sample": TOKENS, "tp_degree": tp_degree,
            "pp_degree": pp_degree, "precision": "fp32", "comm_hook": "allreduce", "steps": 1, "warmup_steps": 1}
    times = {"strategy": "ddp", "world_size": world_size, "dp_degree": world_size // (tp_degree * pp_degree),
             "vocab_size": 261, "step_s": [step], "optimizer_s": [0.01], "compute_step_s": [],
             "compute_optimizer_s": [], "memory": [{"total_bytes": 1}]}
    return {"spec": spec, "strategies": [times], "peak_flops_per_rank": 1e9, "threads_per_rank": 1,
            "host_cores": 2, "device": "cpu", "torch": "2"}


def test_points_measured_under_load_are_marked_as_noise(monkeypatch, capsys):
    """A 1-minute load average above the cores the suite's ranks use marks the point, its
    efficiency (above 1 here, as a loaded machine gave) and its planner miss as noise; a load
    up to those cores, which the suite's own ranks make, marks nothing."""
    loads = iter([1.5, 2.0, 1.9, 9.3])  # before and after the 1-rank launch, then the 2-rank launch
    monkeypatch.setattr(os, "getloadavg", lambda: (next(loads), 0.0, 0.0))
    one = scaling.with_load(lambda: hand_built_launch(1, 0.5), 2, "1 rank")
    two = scaling.with_load(lambda: hand_built_launch(2, 0.4), 2, "2 ranks")
    assert capsys.readouterr().err == (
        "[2 ranks] under load: the 1-minute load average was 1.90 before and 9.30 after, above the 2 cores the "
        "suite's ranks use; this launch's times are noise\n")
    rows = results.point_rows([one, two], {"arch": "roberta_tiny", "mode": "weak", "strategies": ["ddp"]})
    by_size = {row["world_size"]: row for row in rows}
    assert [(row["under_load"], row["load_average_max"], row["load_cores"]) for row in rows] == [
        (False, 2.0, 2), (True, 9.3, 2)]
    assert by_size[2]["efficiency"] == pytest.approx(1.25)  # per-rank tokens/s above the one rank's
    by_size[2]["predicted_step_time_s"] = 0.6  # a planner miss of 50 %
    table = results.markdown_table(rows).splitlines()
    one_line, two_line = (next(line for line in table if line.startswith(f"| {n} | ddp |")) for n in (1, 2))
    assert "*" not in one_line
    assert "| 0.4000* |" in two_line and "| 0.6000 (+50%)* |" in two_line and "| 1.250* |" in two_line
    assert any(line.startswith("**Noise.** 1 of 2 points were measured under load (1-minute load average up to "
                               "9.30, above the 2 cores the suite's ranks use)") for line in table), table


def test_a_tensor_parallel_point_is_against_the_one_rank_point():
    """Rows of a sweep with tp 1 and 2: the tp-2 series' efficiency is its tokens/s per rank
    over the 1-rank point's, the point every tp-1 series starts from."""
    def launch(world_size: int, tp_degree: int, step: float) -> dict:
        return hand_built_launch(world_size, step, tp_degree=tp_degree)

    combos = [["ddp", "allreduce", 1], ["ddp", "allreduce", 2]]
    rows = results.point_rows([launch(1, 1, 0.5), launch(2, 1, 0.6), launch(2, 2, 0.8), launch(4, 2, 0.9)],
                              {"arch": "roberta_tiny", "mode": "weak", "strategies": ["ddp"], "combinations": combos})
    by_point = {(row["world_size"], row["tp_degree"]): row for row in rows}
    assert set(by_point) == {(1, 1), (2, 1), (2, 2), (4, 2)}
    one = by_point[(1, 1)]["tokens_per_s"]
    for (world_size, tp_degree), row in by_point.items():
        assert row["efficiency_baseline_world_size"] == 1
        assert row["efficiency"] == pytest.approx(row["tokens_per_s"] / world_size / one)
    assert by_point[(2, 2)]["tokens_per_s"] == pytest.approx(4 * TOKENS / 0.8)  # one replica of 4 samples


def test_pp_degrees_are_swept_and_handed_to_distlm_train(tmp_path):
    """--pp-degree takes a list like --tp-degree: each degree with every tp degree whose
    product with it divides the world size, checked by distlm.train's own validation and
    handed to it above 1 with the pipeline flags, the replicas' batch split over world /
    (tp x pp). (The sweep above runs a pp-2 point for real.)"""
    args = scaling.parse_args(["--ranks", "1,2,4", "--strategy", "ddp,fsdp", "--tp-degree", "1,2", "--pp-degree",
                               "1,2", "--pp-schedule", "gpipe", "--mode", "strong", "--global-batch-size", "8",
                               "--no-plots", "--out", str(tmp_path)])
    planned = scaling.plan_launches(args, [1, 2, 4])
    measured = {(launch.world_size, launch.tp_degree, launch.pp_degree, launch.strategies)
                for launch in scaling.measured_launches(planned)}
    assert measured == {
        (1, 1, 1, ("ddp",)),
        (2, 1, 1, ("ddp", "fsdp")), (2, 2, 1, ("ddp",)), (2, 1, 2, ("ddp",)),
        (4, 1, 1, ("ddp", "fsdp")), (4, 2, 1, ("ddp", "fsdp")), (4, 1, 2, ("ddp", "fsdp")), (4, 2, 2, ("ddp",)),
    }
    assert ["ddp", "allreduce", 1, 2] in scaling.combinations(planned)
    for launch in planned:
        spec = scaling.launch_spec(args, launch, list(launch.strategies), [1, 2, 4])
        flags = spec.trainer_flags("ddp")
        assert ("--pp-degree" in flags) == (launch.pp_degree > 1)
        if launch.pp_degree > 1:
            settings = spec.trainer_config("ddp").distributed
            assert (settings.pp_degree, settings.pp_schedule) == (launch.pp_degree, "gpipe")
        replicas = launch.world_size // (launch.tp_degree * launch.pp_degree)
        assert int(flags[flags.index("--batch-size") + 1]) * replicas == 8  # strong scaling: one global batch
    with pytest.raises(UsageError, match="--ranks 3 is not a multiple of --tp-degree 2 x --pp-degree 2"):
        scaling.check_ranks([3], [2], [2])


def test_a_pipeline_point_is_against_the_one_rank_point():
    """A pp-2 series is its own series ("ddp pp2"), its efficiency against the plain 1-rank point."""
    def launch(world_size: int, pp_degree: int, step: float) -> dict:
        return hand_built_launch(world_size, step, pp_degree=pp_degree)

    combos = [["ddp", "allreduce", 1], ["ddp", "allreduce", 1, 2]]
    rows = results.point_rows([launch(1, 1, 0.5), launch(2, 1, 0.6), launch(2, 2, 0.4), launch(4, 2, 0.5)],
                              {"arch": "roberta_tiny", "mode": "weak", "strategies": ["ddp"], "combinations": combos})
    by_point = {(row["world_size"], row["pp_degree"]): row for row in rows}
    assert set(by_point) == {(1, 1), (2, 1), (2, 2), (4, 2)}
    assert {results.series_label(row) for row in rows} == {"ddp", "ddp pp2"}
    one = by_point[(1, 1)]["tokens_per_s"]
    for (world_size, _), row in by_point.items():
        assert row["efficiency_baseline_world_size"] == 1
        assert row["efficiency"] == pytest.approx(row["tokens_per_s"] / world_size / one)


@pytest.mark.parametrize("argv, expected", [
    (["--ranks", "0"], "--ranks must be at least 1, got 0"),
    (["--ranks", "1,two"], "--ranks takes comma-separated whole numbers"),
    (["--strategy", "ddp,dpp"], "--strategy dpp is unknown"),
    (["--mode", "weak", "--global-batch-size", "8"], "add --mode strong"),
    (["--mode", "strong", "--ranks", "1,2", "--global-batch-size", "3"], "set --global-batch-size to a multiple of 2"),
    (["--arch", "roberta_huge"], "--arch roberta_huge is unknown"),
    (["--strategy", "fsdp", "--comm-hook", "fp16", "--ranks", "2"], "--comm-hook"),
    (["--comm-hook", "allreduce,fp32"], "--comm-hook fp32 is unknown"),
    (["--tp-degree", "2,4", "--ranks", "1,2"], "--ranks 1 is not a multiple of --tp-degree 2,4"),
    (["--tp-degree", "1,1"], "names a degree twice"),
    (["--pp-schedule", "gpipe"], "add --pp-degree with a degree above 1"),
    (["--pp-degree", "1,2", "--pp-schedule", "gpipe2"], "--pp-schedule: invalid choice"),
    (["--pp-degree", "1,2", "--pp-microbatches", "-1"], "--pp-microbatches must be 0"),
    (["--pp-degree", "2", "--ranks", "2", "--batch-size", "3"], "--batch-size 3 does not split into"),
])
def test_bad_input_is_one_line_and_exit_2(argv, expected, tmp_path, capsys):
    assert bench_main(["scaling", *argv, "--no-plots", "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("distlm.bench: error: ") and expected in err, err
    assert not (tmp_path / "out").exists()  # refused before anything ran


def test_command_line_exits_2_without_traceback(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "distlm.bench", "scaling", "--ranks", "0", "--out", str(tmp_path)],
                          capture_output=True, text=True, timeout=TIMEOUT, env=subprocess_env())
    assert proc.returncode == 2
    assert proc.stderr == "distlm.bench: error: --ranks must be at least 1, got 0\n"
