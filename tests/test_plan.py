"""The planner (distlm.plan): FLOP and parameter counts against torch and transformers,
the alpha-beta communication model against hand-computed collectives, CPU ranks sharing
cores, its memory against what real gloo ranks hold, calibration, the command line; and
the peak FLOP/s and MFU of the training log (Trainium named by its instance type)."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.flop_counter import FlopCounterMode

from distributed import run_distributed
from distlm.observe.printer import strict_json
from distlm.training import stats as metrics
from distlm.backends import hardware
from distlm.backends.hardware import peak_flops
from distlm.errors import UsageError
from distlm.models import arch_names, build_model
from distlm.plan import __main__ as plan_cli
from distlm.models import flops
from distlm.plan.calibrate import calibrate, read_measurements
from distlm.models.flops import (
    count_parameter_tensors,
    count_parameters,
    flops_per_token,
    model_shape,
    parameter_groups,
)
from distlm.layout import Layout, PipelineLayout
from distlm.plan.model import (
    SPLIT_BACKWARD_COST,
    Cluster,
    Group,
    Link,
    Placement,
    Stage,
    Workload,
    activation_bytes_per_rank,
    micro_batch_segments,
    all_gather_time,
    all_to_all_bytes_per_micro,
    all_to_all_time,
    collective_slowdown,
    collective_time,
    ddp_communication,
    executed_flops_per_token,
    gradient_allreduce_time,
    hierarchical_allreduce_time,
    load_cluster,
    local_parameters,
    memory_per_rank,
    project,
    ring_allreduce_time,
    tree_allreduce_time,
)
from distlm.plan.schedule import ActionTimes, pass_seconds, zero_bubble_orders
from distlm.train import main as train_main

SEQ_LEN, BATCH = 32, 2


# ------------------------------------------------------------------------------ FLOPs


@pytest.mark.parametrize("arch", ["llama_tiny", "roberta_tiny"])
def test_flops_per_token_matches_torch_flop_counter(arch):
    """One forward + backward of the full logits, counted by torch's FlopCounterMode.

    CPU's fused SDPA kernel has no FLOP formula in FlopCounterMode (it counts 0), so the
    math backend runs the same QK^T and AV products as countable bmm calls.
    """
    torch.manual_seed(0)
    model = build_model(arch, vocab_size=261)
    tokens = torch.randint(4, 261, (BATCH, SEQ_LEN))  # no padding id: every position is real
    with sdpa_kernel(SDPBackend.MATH), FlopCounterMode(display=False) as counter:
        logits = model(tokens)
        F.cross_entropy(logits.flatten(0, 1), tokens.flatten()).backward()
    measured = counter.get_total_flops()
    predicted = flops_per_token(model, SEQ_LEN) * BATCH * SEQ_LEN
    assert abs(predicted / measured - 1) < 0.05, (arch, predicted, measured)


@pytest.mark.parametrize("vocab_size", [261, 50265])
def test_parameter_count_is_exact_for_every_arch(vocab_size):
    for arch in arch_names():
        with torch.device("meta"):
            model = build_model(arch, vocab_size=vocab_size)
        built = sum(p.numel() for p in model.parameters())
        assert count_parameters(model_shape(arch, vocab_size)) == built, arch
        assert count_parameters(model) == built, arch
        assert count_parameter_tensors(model) == len(list(model.parameters())), arch


def test_hugging_face_configs_are_read_as_transformers_builds_them(tmp_path):
    """The standard config.json fields give the parameter count of transformers' own model
    (for RoBERTa less its token-type table, which distlm's layout has none of)."""
    transformers = pytest.importorskip("transformers")
    configs = {
        "llama": transformers.LlamaConfig(
            hidden_size=256, intermediate_size=688, num_hidden_layers=3, num_attention_heads=8,
            num_key_value_heads=2, vocab_size=1000, max_position_embeddings=512,
        ),
        "roberta": transformers.RobertaConfig(
            hidden_size=128, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
            vocab_size=1000, max_position_embeddings=130, type_vocab_size=1,
        ),
    }
    for name, config in configs.items():
        path = tmp_path / f"{name}.json"
        path.write_text(config.to_json_string())
        with torch.device("meta"):
            model = (transformers.LlamaForCausalLM if name == "llama" else transformers.RobertaForMaskedLM)(config)
        hf_count = sum(p.numel() for p in model.parameters())
        token_types = config.type_vocab_size * config.hidden_size if name == "roberta" else 0
        assert count_parameters(str(path)) == hf_count - token_types, name


# ----------------------------------------------------------------------- communication


def test_ring_allreduce_time_is_the_alpha_beta_formula():
    # Ring all-reduce of n = 100 MB over p = 8 ranks, alpha = 10 us per step, B = 50 GB/s:
    #   2 (p-1) alpha           = 2 * 7 * 10e-6            = 1.4e-4 s
    #   2 (p-1)/p * n / B       = 2 * 7/8 * 1e8 / 50e9     = 3.5e-3 s
    #   total                                               = 3.64e-3 s
    link = Link(latency_s=10e-6, bandwidth_Bps=50e9)
    assert ring_allreduce_time(100e6, 8, link) == pytest.approx(3.64e-3, rel=1e-12)
    assert ring_allreduce_time(100e6, 1, link) == 0.0


def _cluster(**changes) -> Cluster:
    base = Cluster(
        name="test", device_type="cuda", device="A100", ranks_per_node=8, memory_bytes_per_rank=40e9,
        memory_bandwidth_Bps=1.5e12, intra=Link(5e-6, 200e9), inter=Link(20e-6, 40e9),
        achieved_fraction={"bf16": 0.5},
    )
    return dataclasses.replace(base, **changes)


def test_gradient_allreduce_crosses_the_shared_node_network():
    # 4 nodes x 8 ranks, flat ring of p = 32 over the network: each step waits for a network
    # hop (alpha = 20 us), and each node's 40 GB/s carries the ring's traffic:
    #   2 * 31 * 20e-6 + 2 * 31/32 * 64e6 / 40e9 = 1.24e-3 + 3.1e-3 = 4.34e-3 s
    cluster, layout = _cluster(), Placement(nodes=4, ranks_per_node=8)
    workload = Workload(shape=model_shape("llama_tiny"), precision="bf16")
    assert gradient_allreduce_time(64e6, workload, layout, cluster) == pytest.approx(4.34e-3, rel=1e-9)
    # fp16 hook: half the bytes on the wire.
    fp16 = dataclasses.replace(workload, layout=Layout(comm_hook="fp16"))
    assert gradient_allreduce_time(64e6, fp16, layout, cluster) == pytest.approx(1.24e-3 + 1.55e-3, rel=1e-9)
    # Hierarchical: reduce-scatter and all-gather in the node (7 steps of 5 us and 7/8 of the
    # bytes at 200 GB/s each), then 8 rings of 4 nodes over 8 MB shards sharing 40 GB/s:
    #   2 * (7 * 5e-6 + 7/8 * 64e6 / 200e9) + 2 * 3 * 20e-6 + 2 * 3/4 * 8e6 / (40e9 / 8)
    expected = 2 * (7 * 5e-6 + 7 / 8 * 64e6 / 200e9) + 2 * 3 * 20e-6 + 2 * 3 / 4 * 8e6 / 5e9
    assert hierarchical_allreduce_time(64e6, 4, 8, cluster) == pytest.approx(expected, rel=1e-9)


def test_ddp_hides_all_but_what_backward_completes_last_and_double_buffering_hides_that_too():
    """When every bucket all-reduces faster than backward fills the next, DDP waits only for
    the tail: the buckets complete when backward ends (the embedding table's gradient comes
    last) and the one the last block closed. Double buffering gives those a whole step."""
    cluster = _cluster(intra=Link(5e-6, 20e9))
    layout = Placement(nodes=1, ranks_per_node=8)
    workload = Workload(shape=model_shape("llama2_7b"), precision="bf16", tokens_per_sample=1024, batch_size=32)
    row = project(workload, cluster, layout)
    _, backward, _ = micro_batch_segments(workload, layout, cluster)
    buckets = ddp_communication(workload, layout, cluster, backward)
    backward_end = sum(segment.seconds for segment in backward)
    early = [bucket for bucket in buckets if bucket[0] < backward_end - 1e-9]
    last = [bucket for bucket in buckets if bucket[0] >= backward_end - 1e-9]
    assert early and last
    for ready, end, seconds in early:
        assert end - ready == pytest.approx(seconds), "a bucket filled during backward waited for another"
    assert all(end <= backward_end for _, end, _ in early[:-1])
    # Exposed: the buckets complete at the end, and at most the one block 0 closed just before;
    # and the update's all-reduce of the target-token count (8 bytes, the faster of ring and
    # tree) before its forward.
    tail = sum(seconds for _, _, seconds in last)
    token_count = min(ring_allreduce_time(8, 8, cluster.intra), tree_allreduce_time(8, 8, cluster.intra))
    assert tail + token_count <= row.comm_exposed_s <= tail + early[-1][2] + token_count + 1e-12
    buffered = project(dataclasses.replace(workload, layout=Layout(double_buffering=True)), cluster, layout)
    assert buffered.comm_exposed_s == pytest.approx(token_count) and buffered.step_time_s < row.step_time_s


def test_fsdp_exposes_its_first_all_gathers():
    """FSDP's first block cannot start before the root's and its own all-gather."""
    cluster = _cluster(intra=Link(5e-6, 20e9))
    layout = Placement(nodes=1, ranks_per_node=8)
    workload = Workload(shape=model_shape("llama2_7b"), layout=Layout(strategy="fsdp"), precision="bf16",
                        tokens_per_sample=1024)
    row = project(workload, cluster, layout)
    counts = parameter_groups(model_shape("llama2_7b"))
    first = all_gather_time(2 * (counts.embedding + counts.head), 8, cluster.intra) + all_gather_time(
        2 * counts.per_block, 8, cluster.intra
    )
    assert row.comm_exposed_s >= first
    assert row.comm_exposed_s < row.dp_comm_s  # most of it hides behind compute


# ----------------------------------------------------------------------------- memory


# (arch, strategy, --ep-degree) of the runs whose memory the planner must predict.
MEMORY_RUNS = [("llama_tiny", "ddp", 1), ("llama_tiny", "zero1", 1), ("llama_tiny", "fsdp", 1),
               ("qwen3_moe_tiny", "ddp", 2), ("qwen3_moe_tiny", "fsdp", 2)]


def _memory_under_each_strategy(data: str) -> dict:
    from distlm import TrainConfig, Trainer

    reports = {}
    vocab_size = None
    for arch, strategy, ep in MEMORY_RUNS:
        config = TrainConfig()
        config.model.arch = arch
        config.data.data = data
        config.data.batch_size = 2
        config.data.tokens_per_sample = 32
        config.distributed.strategy = strategy
        config.distributed.ep_degree = ep
        config.distributed.device = "cpu"
        config.optim.max_update = 1
        config.checkpoint.no_save = True
        config.logging.log_format = "json"
        trainer = Trainer(config)
        vocab_size = len(trainer.data.dictionary)
        reports[arch, strategy, ep] = trainer.fit()["memory_bytes_per_rank"]
    return {"reports": reports, "vocab_size": vocab_size}


def test_memory_per_rank_matches_real_ranks(data_dir):  # noqa: F811 - fixture
    """ddp 16Ψ, zero1 4Ψ + 4Ψ + 8Ψ/N, fsdp 16Ψ/N against the bytes 2 gloo ranks hold (every
    run one after another in one process group); under expert parallel 2 the dense part so,
    and half of the experts whole (16 bytes each) beside it."""
    result = run_distributed(_memory_under_each_strategy, 2, data_dir, timeout=180)[0]
    for (arch, strategy, ep), ranks in result["reports"].items():
        shape = model_shape(arch, result["vocab_size"])
        layout = Layout(strategy=strategy, ep_degree=ep)
        predicted = memory_per_rank(Workload(shape=shape, layout=layout),
                                    Placement(nodes=1, ranks_per_node=2, layout=layout))
        for rank, measured in enumerate(ranks):
            for key in ("param_bytes", "grad_bytes", "optimizer_bytes", "total_bytes"):
                error = abs(predicted[key] / measured[key] - 1)
                assert error < 0.02, (arch, strategy, ep, rank, key, predicted[key], measured[key])


# ------------------------------------------------------------------------ calibration


def test_calibration_recovers_alpha_beta_and_achieved_flops(tmp_path):
    """Points made from a known link (latency 80 us per step, 2 GB/s) and a one-rank row made
    from a known compute rate: the fit gives them back."""
    latency, bandwidth, ranks = 80e-6, 2e9, 2
    sizes = [65536 * 4**i for i in range(5)]
    def ring_seconds(n: float) -> float:
        return 2 * (ranks - 1) * latency + 2 * (ranks - 1) / ranks * n / bandwidth

    # The fp16 rows (slower here) must be ignored: only the plain all-reduce fits the link.
    report = {
        "benchmark": "allreduce", "world_size": ranks, "ranks_per_node": ranks,
        "collectives": [{"size_bytes": n, "method": "plain", "median_s": ring_seconds(n)} for n in sizes]
        + [{"size_bytes": n, "method": "fp16", "median_s": 3 * ring_seconds(n)} for n in sizes],
    }
    rate, tokens, batch = 40e9, 64, 4
    compute_s = batch * tokens * flops_per_token(model_shape("llama_tiny"), tokens) / rate
    row = {
        "world_size": 1, "strategy": "ddp", "tokens_per_s": 1.0, "step_time_s": compute_s, "compute_s": compute_s,
        "comm_exposed_s": 0.0, "optimizer_s": 0.0, "memory_bytes_per_rank": 0, "mfu": 0.1, "efficiency": 1.0,
        "arch": "llama_tiny", "batch_size": batch, "tokens_per_sample": tokens, "precision": "fp32",
    }
    path = tmp_path / "measured.jsonl"
    path.write_text(json.dumps(report, indent=2) + "\n" + json.dumps(row) + "\n")
    result = calibrate(read_measurements(path))
    assert result.intra.latency_s == pytest.approx(latency, rel=1e-6)
    assert result.intra.bandwidth_Bps == pytest.approx(bandwidth, rel=1e-6)
    assert result.achieved_flops["fp32"] == pytest.approx(rate, rel=1e-9)


def test_calibration_reads_host_sharing_and_dtensor_dispatch(tmp_path):
    """A one-rank row and a row of 4 one-rank updates at once (half the batch; the slowest
    of 4 at 1/2.5 of the rate, the mean at 1/2.2; the optimizer 2.4x slower): the planner's
    4-rank slowdowns are 2.5 and 2.4, not the cores' ratio; the DTensor overhead is spread
    over llama_tiny's 39 tensors."""
    rate, tokens, batch = 40e9, 64, 4
    shape = model_shape("llama_tiny")

    def compute_seconds(samples: int, flops_rate: float) -> float:
        return samples * tokens * executed_flops_per_token(shape, tokens) / flops_rate

    one_rank = {
        "world_size": 1, "strategy": "ddp", "tokens_per_s": 1.0, "step_time_s": 1.0,
        "compute_s": compute_seconds(batch, rate), "comm_exposed_s": 0.0, "optimizer_s": 0.01,
        "dtensor_optimizer_overhead_s": 0.0039, "memory_bytes_per_rank": 0, "mfu": 0.1, "efficiency": 1.0,
        "arch": "llama_tiny", "batch_size": batch, "tokens_per_sample": tokens, "precision": "fp32",
        "threads_per_rank": 1, "host_cores": 2,
    }
    sharing = {
        "benchmark": "host_sharing", "processes": 4, "arch": "llama_tiny", "tokens_per_sample": tokens,
        "batch_size": batch // 2, "update_freq": 1, "precision": "fp32", "threads_per_rank": 1,
        "compute_s": compute_seconds(batch // 2, rate / 2.2),
        "slowest_compute_s": compute_seconds(batch // 2, rate / 2.5), "optimizer_s": 0.024,
    }
    path = tmp_path / "calibration.jsonl"
    path.write_text(json.dumps(one_rank) + "\n" + json.dumps(sharing) + "\n")
    result = calibrate(read_measurements(path))
    assert result.host_sharing[4] == pytest.approx((2.5, 2.4), rel=1e-9)
    assert result.dtensor_step_per_tensor_s == pytest.approx(0.0039 / 39)
    cluster = result.apply(load_cluster("local"))
    workload = Workload(shape=shape, layout=Layout(strategy="fsdp"), tokens_per_sample=tokens, batch_size=batch)
    four, two = (project(workload, cluster, Placement(nodes=1, ranks_per_node=r)) for r in (4, 2))
    assert four.compute_slowdown == pytest.approx(2.5) and two.compute_slowdown == 1.0  # 2 ranks: not measured
    assert four.compute_s == pytest.approx(2.5 * one_rank["compute_s"])

    probe = {"benchmark": "allreduce", "world_size": 2, "ranks_per_node": 2, "collectives": [
        {"size_bytes": 65536, "method": "plain", "median_s": 1e-3},
        {"size_bytes": 262144, "method": "plain", "median_s": 2e-3},
    ]}
    path.write_text(json.dumps(probe) + "\n" + json.dumps(sharing) + "\n")
    with pytest.raises(UsageError, match="one-rank scaling rows"):
        calibrate(read_measurements(path))
    path.write_text(json.dumps(one_rank) + "\n" + json.dumps({**sharing, "threads_per_rank": 2}) + "\n")
    with pytest.raises(UsageError, match="threads per rank"):
        calibrate(read_measurements(path))


def test_peak_flops_table_and_cpu_probe():
    assert peak_flops("cuda", torch.bfloat16, "NVIDIA A100-SXM4-40GB") == 312e12
    assert peak_flops("neuron", "bf16", "trainium1") == 95e12
    assert peak_flops("cpu", "fp32") > 1e8  # measured: a timed matmul on this machine
    with pytest.raises(Exception, match="V100 has no bf16"):
        peak_flops("cuda", "bf16", "Tesla V100-SXM2-32GB")


@pytest.fixture
def ec2_product_name(tmp_path, monkeypatch):
    """The DMI product name file EC2 fills, as a file of the test's; no overrides set."""
    path = tmp_path / "product_name"
    monkeypatch.setattr(hardware, "PRODUCT_NAME_PATH", path)
    monkeypatch.delenv(hardware.INSTANCE_TYPE_VARIABLE, raising=False)
    monkeypatch.delenv(hardware.PEAK_VARIABLE, raising=False)
    return path


def test_trainium_and_xla_devices_are_named_by_the_instance_type(ec2_product_name, monkeypatch):
    # AWS's figures: a Trainium1 chip does 190 bf16 TFLOPS with two NeuronCore-v2 (one
    # rank each); a Trainium2 chip 667 with four logical cores of LNC=2.
    trn1, trn2 = 190e12 / 2, 667e12 / 4
    for device_type in ("neuron", "xla"):
        with pytest.raises(UsageError, match=hardware.INSTANCE_TYPE_VARIABLE):
            peak_flops(device_type, "bf16")  # no product name: says how to give one
    ec2_product_name.write_text("trn1.32xlarge\n")
    assert peak_flops("neuron", "bf16") == pytest.approx(trn1)
    assert peak_flops("xla", torch.bfloat16) == pytest.approx(trn1)
    ec2_product_name.write_text("trn2.48xlarge\n")
    assert peak_flops("xla", "bf16") == pytest.approx(trn2)
    monkeypatch.setenv(hardware.INSTANCE_TYPE_VARIABLE, "trn1n.32xlarge")  # a container's override wins
    assert peak_flops("neuron", "bf16") == pytest.approx(trn1)
    monkeypatch.setenv(hardware.INSTANCE_TYPE_VARIABLE, "m5.xlarge")
    with pytest.raises(UsageError, match="m5.xlarge"):
        peak_flops("xla", "bf16")
    monkeypatch.setenv(hardware.PEAK_VARIABLE, "120")
    assert hardware.device_peak_flops("xla", "bf16") == 120e12


def test_a_device_without_peak_logs_once_and_prints_null_mfu(ec2_product_name, monkeypatch, caplog):
    monkeypatch.setattr(metrics, "_REPORTED_WITHOUT_PEAK", set())
    model = build_model("llama_tiny", vocab_size=261)
    with caplog.at_level("WARNING", logger="distlm"):
        for _ in range(2):
            per_token, peak = metrics.mfu_inputs(model, SEQ_LEN, "xla", torch.bfloat16)
    assert per_token == flops_per_token(model, SEQ_LEN) and peak is None
    reports = [record.getMessage() for record in caplog.records if "mfu" in record.getMessage()]
    assert len(reports) == 1 and "xla" in reports[0] and hardware.INSTANCE_TYPE_VARIABLE in reports[0], reports
    stats = metrics.TrainStats("cpu", per_token, peak, devices=2)
    stats.add(torch.tensor(10.0), target_tokens=64, input_tokens=64, samples=2)
    record = stats.reduce(None)
    assert record["mfu"] is None and record["tokens_per_sec_per_device"] > 0
    assert '"mfu": null' in json.dumps(strict_json(record))
    assert stats.summary_rates()["mfu"] is None  # the summary, over the one logged interval
    ec2_product_name.write_text("trn1.32xlarge")  # now known: a number
    assert metrics.mfu_inputs(model, SEQ_LEN, "xla", torch.bfloat16)[1] == pytest.approx(190e12 / 2)


def test_train_and_summary_lines_carry_mfu(data_dir, capsys):  # noqa: F811 - fixture
    """A one-process run on CPU: every train line carries tokens/s per device and an MFU
    against the matmul probe, and the summary the steady state's mean (the intervals after
    the first, the first update alone, which holds the warm-up): its tokens over its time, so
    the harmonic mean of those lines' MFUs weighted by their tokens (their updates). Each
    comparison allows 1e-3 relative and a rounding unit of the log's MFU."""
    assert train_main([
        "--arch", "roberta_tiny", "--data", data_dir, "--device", "cpu", "--batch-size", "2",
        "--tokens-per-sample", "32", "--sample-break-mode", "none", "--max-update", "6", "--log-interval", "2",
        "--no-save", "--disable-validation", "--log-format", "json",
    ]) == 0
    lines = [json.loads(line) for line in capsys.readouterr().out.splitlines() if line.startswith("{")]
    train = [line for line in lines if line["kind"] == "train"]
    summary = next(line for line in lines if line["kind"] == "summary")
    assert [line["update"] for line in train] == [1, 2, 4, 6]
    for line in train:
        assert line["tokens_per_sec_per_device"] == pytest.approx(line["wps"], rel=1e-3)  # one device
        assert line["mfu"] > 0
        # The same FLOPs per token over the same peak on every line: MFU proportional to wps
        # (the first line's rounding scales with the ratio of the two lines' wps).
        ratio = line["wps"] / train[0]["wps"]
        assert line["mfu"] == pytest.approx(train[0]["mfu"] * ratio, rel=1e-3, abs=1e-5 * (1 + ratio))
    steady = train[1:]
    updates = [line["update"] - before["update"] for before, line in zip(train, steady)]
    assert summary["rates_over"] == "after_first_interval"
    harmonic = sum(updates) / sum(n / line["mfu"] for n, line in zip(updates, steady))
    assert summary["mfu"] == pytest.approx(harmonic, rel=1e-3, abs=2e-5)


def test_collectives_have_their_own_costs():
    """A measured alpha-beta wins for its group's shape; otherwise ring formulas on the
    link; a backend without a reduce-scatter pays an all-reduce of the whole input."""
    cluster = _cluster(intra=Link(10e-6, 20e9))
    group, n = Group(ranks=4, nodes=1), 64e6
    ring_allreduce = 2 * 3 * 10e-6 + 2 * 3 / 4 * n / 20e9
    ring_gather = 3 * 10e-6 + 3 / 4 * n / 20e9
    assert collective_time("all_reduce", n, group, cluster) == pytest.approx(ring_allreduce)
    assert collective_time("all_gather", n, group, cluster) == pytest.approx(ring_gather)
    assert collective_time("reduce_scatter", n, group, cluster) == pytest.approx(ring_gather)
    gloo = dataclasses.replace(cluster, reduce_scatter_via_allreduce=True,
                               measured_collectives={("all_gather", 4, 4): (2e-3, 1e-9)})
    assert collective_time("reduce_scatter", n, group, gloo) == pytest.approx(ring_allreduce)
    assert collective_time("all_gather", n, group, gloo) == pytest.approx(2e-3 + 1e-9 * n)
    assert collective_time("all_gather", n, Group(ranks=2, nodes=1), gloo) == pytest.approx(10e-6 + n / 2 / 20e9)
    measured = dataclasses.replace(gloo, measured_collectives={("reduce_scatter", 4, 4): (1e-3, 2e-9)})
    assert collective_time("reduce_scatter", n, group, measured) == pytest.approx(1e-3 + 2e-9 * n)


def test_cpu_ranks_share_the_host_cores():
    """On CPU, ranks x threads beyond the cores slow compute and optimizer by their ratio,
    and collectives overlap compute only while a core is idle."""
    shape = model_shape("roberta_tiny", 261)
    cluster = dataclasses.replace(
        load_cluster("local"), achieved_flops={"fp32": 50e9}, cpu_threads_per_rank=1, cores_per_node=2,
    )
    workload = Workload(shape=shape, tokens_per_sample=SEQ_LEN, batch_size=BATCH)
    one, two, four = (project(workload, cluster, Placement(nodes=1, ranks_per_node=r)) for r in (1, 2, 4))
    assert two.compute_s == pytest.approx(one.compute_s) and two.optimizer_s == pytest.approx(one.optimizer_s)
    assert four.compute_s == pytest.approx(2 * one.compute_s) and four.optimizer_s == pytest.approx(2 * one.optimizer_s)
    assert four.compute_slowdown == 2.0 and four.efficiency < 0.5
    for row in (two, four):  # every core computes: the whole all-reduce adds to the step
        assert row.comm_exposed_s == pytest.approx(row.dp_comm_s)
    roomy = dataclasses.replace(cluster, cores_per_node=8)
    spare = project(workload, roomy, Placement(nodes=1, ranks_per_node=2))
    assert spare.compute_slowdown == 1.0 and spare.comm_exposed_s < spare.dp_comm_s
    # Simulated nodes of one host share it too.
    split = project(workload, cluster, Placement(nodes=2, ranks_per_node=2))
    assert split.compute_s == pytest.approx(four.compute_s)


@pytest.mark.parametrize("ranks, threads, cores, slowdown", [
    (2, 1, 2, 2.0),  # each core: one compute thread and one communication thread; alone: one
    (4, 1, 2, 2.0),  # each core: two and two; alone: two communication threads
    (2, 2, 4, 1.5),  # 6 runnable threads on 4 cores; alone: 2 on 4
    (2, 1, 8, 1.0),  # spare cores: the collective runs on one of them
])
def test_a_cpu_collective_beside_compute_shares_its_cores(ranks, threads, cores, slowdown):
    cluster = dataclasses.replace(load_cluster("local"), cpu_threads_per_rank=threads, cores_per_node=cores)
    assert collective_slowdown(Placement(nodes=1, ranks_per_node=ranks), cluster) == pytest.approx(slowdown)
    assert collective_slowdown(Placement(nodes=1, ranks_per_node=ranks), load_cluster("p4d.24xlarge")) == 1.0


def test_only_collectives_issued_during_compute_are_slowed():
    """On two one-thread ranks over two cores, FSDP's prefetched all-gathers and its
    reduce-scatters behind later blocks take twice their probed time; the two all-gathers
    the update starts by waiting for, and the two reduce-scatters after the last compute,
    take theirs. DDP: the bucket filled during backward doubles, the last one does not."""
    shape = model_shape("roberta_tiny", 261)
    cluster = dataclasses.replace(
        load_cluster("local"), achieved_flops={"fp32": 50e9}, cpu_threads_per_rank=1, cores_per_node=2,
    )
    spare = dataclasses.replace(cluster, cores_per_node=1000)
    layout = Placement(nodes=1, ranks_per_node=2)
    groups = parameter_groups(shape)
    group = layout.dp_group()
    n = groups.blocks
    token_count = collective_time("all_reduce", 8, group, cluster, "auto")
    gather = lambda params: collective_time("all_gather", 4 * params, group, cluster)  # noqa: E731
    scatter = lambda params: collective_time("reduce_scatter", 4 * params, group, cluster)  # noqa: E731
    root, block = groups.embedding + groups.head, groups.per_block
    waited = gather(root) + gather(block) + scatter(block) + scatter(root)
    prefetched = (2 * n - 2) * gather(block) + (n - 1) * scatter(block)
    fsdp = Workload(shape=shape, layout=Layout(strategy="fsdp"), tokens_per_sample=SEQ_LEN, batch_size=BATCH)
    assert project(fsdp, cluster, layout).dp_comm_s == pytest.approx(waited + 2 * prefetched + token_count)
    assert project(fsdp, spare, layout).dp_comm_s == pytest.approx(waited + prefetched + token_count)
    ddp = Workload(shape=shape, layout=Layout(strategy="ddp"), tokens_per_sample=SEQ_LEN, batch_size=BATCH)
    total = 4 * count_parameters(shape)
    first, rest = (collective_time("all_reduce", b, group, cluster) for b in (2**20, total - 2**20))
    assert project(ddp, cluster, layout).dp_comm_s == pytest.approx(2 * first + rest + token_count)


# --------------------------------------------------------------------------- command line


def test_cli_json_rows(capsys):
    assert plan_cli.main(["--arch", "llama_tiny", "--cluster", "local", "--ranks", "1,2,4", "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert [row["ranks"] for row in rows] == [1, 2, 4]
    assert [row["nodes"] for row in rows] == [1, 1, 1]  # --ranks on this machine: one host
    for row in rows:
        for key in ("nodes", "ranks", "step_time_s", "tokens_per_s", "efficiency", "memory_bytes_per_rank",
                    "compute_s", "comm_exposed_s", "optimizer_s"):
            assert key in row, key
    assert rows[0]["efficiency"] == pytest.approx(1.0)


def test_cli_bad_cluster_is_one_line_and_exit_2():
    result = subprocess.run(
        [sys.executable, "-m", "distlm.plan", "--arch", "llama_tiny", "--cluster", "p9.nonexistent"],
        capture_output=True, text=True, timeout=120,
    )
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("distlm.plan: error: --cluster p9.nonexistent"), result.stderr


def test_every_bundled_profile_loads():
    for name in ("p3dn.24xlarge", "p4d.24xlarge", "p5.48xlarge", "trn1.32xlarge", "trn2.48xlarge", "local"):
        cluster = load_cluster(name)
        assert cluster.ranks_per_node >= 1 and cluster.inter.bandwidth_Bps > 0


# ------------------------------------------------------------------ pipeline parallel

LLAMA3_8B = model_shape("llama3_8b")  # 32 blocks: 8 per stage at pp 4
EXAMPLES = Path(__file__).resolve().parent.parent / "examples"


def pipelined(schedule: str = "1f1b", microbatches: int = 8, stages_per_rank: int = 1):
    """Llama-3-8B at pp 4 x tp 2 on one p4d node (dp 1): the update is its pipeline passes
    and the optimizer step, nothing data-parallel."""
    layout = Layout(tp_degree=2, pp_degree=4, pipeline=PipelineLayout(schedule, microbatches, stages_per_rank))
    workload = Workload(shape=LLAMA3_8B, layout=layout, precision="bf16", tokens_per_sample=2048, batch_size=8)
    return project(workload, load_cluster("p4d.24xlarge"), Placement(nodes=1, ranks_per_node=8, layout=layout))


@pytest.mark.parametrize("schedule", ["1f1b", "gpipe"])
def test_pipeline_bubble_is_p_minus_1_over_m_plus_p_minus_1(schedule):
    for microbatches in (4, 8):
        row = pipelined(schedule, microbatches)
        assert (row.dp_degree, row.pp_degree, row.pp_microbatches) == (1, 4, microbatches)
        passes = row.step_time_s - row.optimizer_s  # dp 1: nothing else follows the passes
        assert row.pp_bubble_s / passes == pytest.approx(3 / (microbatches + 3))
        assert row.pp_p2p_s > 0


def test_interleaving_divides_the_bubble_and_holds_more_in_flight():
    plain, looped = pipelined("1f1b"), pipelined("interleaved-1f1b", stages_per_rank=2)
    # The same stages (8 blocks per rank, as 2 chunks of 4), so the same slot.
    assert looped.pp_bubble_s == pytest.approx(plain.pp_bubble_s / 2)
    assert looped.step_time_s == pytest.approx(plain.step_time_s - plain.pp_bubble_s / 2)
    # The first rank holds P = 4 micro-batches under 1F1B, P + (P-1)/V = 5.5 interleaved.
    assert looped.activation_bytes_per_rank == pytest.approx(plain.activation_bytes_per_rank * 5.5 / 4)


def test_a_zbv_pass_played_out_by_hand():
    """ZBV at P = 2, M = 2, each action 1 s, free transfers (stages 0 and 3 on rank 0, 1 and 2
    on rank 1). Rank 0 runs F0.0 0-1, F0.1 1-2; rank 1 F1.0 1-2, F2.0 2-3, F1.1 3-4, F2.1 4-5;
    rank 0 F3.0 3-4, I3.0 4-5 (the loss is its own), W3.0 5-6, F3.1 6-7, I3.1 7-8, W3.1 8-9;
    rank 1 I2.0 5-6, W2.0 6-7, I1.0 7-8, W1.0 8-9, I2.1 9-10 (after I3.1 at 8), W2.1 10-11,
    I1.1 11-12, W1.1 12-13; rank 0 I0.0 9-10 (free at 9), W0.0 10-11, I0.1 12-13 (after I1.1),
    W0.1 13-14: 14 s for 12 s of work on each rank."""
    orders = zero_bubble_orders("zbv", pp=2, microbatches=2, stages_per_rank=2)
    assert orders[0] == [("F", 0, 0), ("F", 0, 1), ("F", 3, 0), ("I", 3, 0), ("W", 3, 0), ("F", 3, 1),
                         ("I", 3, 1), ("W", 3, 1), ("I", 0, 0), ("W", 0, 0), ("I", 0, 1), ("W", 0, 1)]
    assert pass_seconds(orders, "zbv", ActionTimes(1, 1, 1, 0)) == 14
    # A transfer of 0.5 s delays each hop between the ranks: rank 1's F1.0 starts at 1.5, ...
    assert pass_seconds(orders, "zbv", ActionTimes(1, 1, 1, 0.5)) > 14


def test_zero_bubble_schedules_charge_the_split_backward_as_played_out():
    """Same stages as 1F1B (8 blocks per rank, as 2 chunks of 4), so the same compute per
    micro-batch c; under zero-bubble each chunk's forward takes c/6 and its input and weight
    gradients c/6 each times SPLIT_BACKWARD_COST, and the pass is torch's order played out."""
    plain = pipelined("1f1b")
    m, passes = plain.pp_microbatches, plain.step_time_s - plain.optimizer_s
    p2p = plain.pp_p2p_s / (2 * m)
    compute = (passes - plain.pp_bubble_s) / m - 2 * p2p
    for schedule in ("zero-bubble", "zbv"):
        row = pipelined(schedule, stages_per_rank=2)
        half = compute / 6 * SPLIT_BACKWARD_COST
        one_pass = pass_seconds(zero_bubble_orders(schedule, 4, m, 2), schedule,
                                ActionTimes(compute / 6, half, half, p2p))
        assert row.step_time_s - row.optimizer_s == pytest.approx(one_pass)
        assert row.pp_bubble_s == pytest.approx(one_pass - m * 2 * (compute / 6 + 2 * half))
        assert row.step_time_s > plain.step_time_s - plain.pp_bubble_s  # the split costs more than it saves


def test_memory_per_rank_counts_only_the_rank_stage():
    row = pipelined("1f1b")
    groups = parameter_groups(LLAMA3_8B)
    tp = 2
    block = (groups.per_block - 2 * LLAMA3_8B.dim) / tp + 2 * LLAMA3_8B.dim  # norms stay whole
    first = 8 * block + groups.embedding / tp
    last = 8 * block + groups.output_projection / tp + LLAMA3_8B.dim
    # The first stage holds 4 micro-batches of activations (1F1B), the last one (and the
    # logits): the first needs most here.
    assert row.param_bytes == pytest.approx(4 * first)
    assert row.memory_bytes_per_rank == pytest.approx(16 * first)  # ddp: weights, gradients, Adam
    stage_layout = Layout(tp_degree=2, pp_degree=4)
    stage = Workload(shape=dataclasses.replace(LLAMA3_8B, n_layers=8), layout=stage_layout, precision="bf16",
                     tokens_per_sample=2048, batch_size=1, stage=Stage(index=0, blocks=8, first=True, last=False))
    layout = Placement(nodes=1, ranks_per_node=8, layout=stage_layout)
    assert row.activation_bytes_per_rank == pytest.approx(4 * activation_bytes_per_rank(stage, layout))
    tp2 = Layout(tp_degree=2)
    whole = project(Workload(shape=LLAMA3_8B, layout=tp2, precision="bf16", tokens_per_sample=2048, batch_size=8),
                    load_cluster("p4d.24xlarge"), Placement(nodes=1, ranks_per_node=2, layout=tp2))
    assert whole.memory_bytes_per_rank > 3 * row.memory_bytes_per_rank


def test_cli_pipeline_json_rows_carry_the_bubble(capsys):
    base = ["--arch", "llama3_8b", "--cluster", "p4d.24xlarge", "--nodes", "1,2", "--tp-degree", "2",
            "--precision", "bf16", "--tokens-per-sample", "2048", "--batch-size", "8", "--json"]
    assert plan_cli.main(base) == 0
    assert all(row["pp_degree"] == 1 and row["pp_bubble_s"] == 0 for row in json.loads(capsys.readouterr().out))
    assert plan_cli.main(base + ["--pp-degree", "4", "--pp-schedule", "interleaved-1f1b",
                                 "--pp-microbatches", "8", "--pp-stages-per-rank", "2"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert [row["dp_degree"] for row in rows] == [1, 2]
    for row in rows:
        assert (row["pp_degree"], row["pp_schedule"], row["pp_microbatches"], row["pp_stages_per_rank"]) == (
            4, "interleaved-1f1b", 8, 2)
        assert 0 < row["pp_bubble_s"] < row["step_time_s"] and row["pp_p2p_s"] > 0


def test_a_70b_hugging_face_config_plans_without_building_anything(capsys, monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("the planner built a module")

    monkeypatch.setattr(torch.nn.Module, "__init__", refuse)
    config = str(EXAMPLES / "slurm" / "llama3_1_70b_config.json")
    argv = ["--arch", config, "--cluster", "trn1.32xlarge", "--nodes", "32", "--strategy", "zero1",
            "--tp-degree", "32", "--pp-degree", "8", "--pp-microbatches", "256", "--batch-size", "256",
            "--precision", "bf16", "--tokens-per-sample", "8192", "--sequence-parallel", "--json"]
    assert plan_cli.main(argv) == 0
    printed = capsys.readouterr()
    (row,) = json.loads(printed.out)
    assert (row["dp_degree"], row["tp_degree"], row["pp_degree"]) == (4, 32, 8)
    assert row["fits"]  # 70.6 B parameters over 8 stages x 32 ranks, ZeRO-1 over 4 replicas
    assert "70.554 B parameters" in printed.err


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--pp-degree", "64", "--ranks", "64"], "--pp-degree 64 x 1 stages per rank exceeds the model's 32 blocks"),
        (["--pp-degree", "3", "--ranks", "8"], "--pp-degree 3 x --tp-degree 1 does not divide the world size 8"),
        (["--pp-degree", "2", "--ranks", "8", "--pp-schedule", "interleaved-1f1b"],
         "--pp-schedule interleaved-1f1b runs several stages per rank; set --pp-stages-per-rank 2 or more"),
        (["--pp-degree", "2", "--ranks", "8", "--pp-stages-per-rank", "2"],
         "--pp-stages-per-rank 2 needs a looped schedule"),
        (["--pp-degree", "2", "--ranks", "8", "--pp-microbatches", "3", "--batch-size", "8"],
         "--batch-size 8 does not split into --pp-microbatches 3"),
        (["--pp-degree", "4", "--ranks", "8", "--pp-microbatches", "2", "--batch-size", "8"],
         "--pp-microbatches 2 is below --pp-degree 4"),
    ],
)
def test_cli_refuses_bad_pipeline_layouts_in_one_line(flags, message, capsys):
    argv = ["--arch", "llama3_8b", "--cluster", "p4d.24xlarge", "--ranks-per-node", "8"]
    assert plan_cli.main(argv + flags) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("distlm.plan: error: " + message), lines


@pytest.mark.parametrize("flags, message", [
    (["--pp-degree", "0"], "--pp-degree must be at least 1, got 0"),  # was a ZeroDivisionError
    (["--tp-degree", "0"], "--tp-degree must be at least 1, got 0"),
    (["--batch-size", "0"], "--batch-size must be at least 1, got 0"),  # was read as the default 16
    (["--bucket-cap-mb", "nan"], "--bucket-cap-mb must be a finite number, got nan"),
])
def test_cli_refuses_in_distlm_train_s_words_what_it_refuses(flags, message, capsys):
    assert plan_cli.main(["--arch", "llama_tiny", "--cluster", "local", *flags]) == 2
    assert capsys.readouterr().err.splitlines() == [f"distlm.plan: error: {message}"]
    assert train_main(["--arch", "llama_tiny", "--device", "cpu", "--no-save", *flags]) == 2
    assert capsys.readouterr().err.splitlines() == [f"distlm: error: {message}"]


def test_cli_names_a_single_block_in_the_singular(tmp_path, capsys):
    config = {"model_type": "llama", "vocab_size": 64, "hidden_size": 32, "intermediate_size": 64,
              "num_hidden_layers": 1, "num_attention_heads": 2, "num_key_value_heads": 2,
              "max_position_embeddings": 128}
    (tmp_path / "config.json").write_text(json.dumps(config))
    assert plan_cli.main(["--arch", str(tmp_path / "config.json"), "--cluster", "local", "--pp-degree", "2"]) == 2
    assert capsys.readouterr().err.splitlines() == [
        "distlm.plan: error: --pp-degree 2 x 1 stages per rank exceeds the model's 1 block; lower --pp-degree"]


# ------------------------------------------------------------------ mixture of experts


def test_moe_compute_counts_a_tokens_experts_and_expert_parallel_splits_the_rest():
    """A token multiplies its top-k experts: the blocks' compute parameters are the active
    ones; expert parallel 2 leaves the dense strategy the dense parameters and each rank
    half of the routed experts (qwen3_moe_tiny: 2 MoE layers of 8 experts of 3 x 64 x 32)."""
    shape = model_shape("qwen3_moe_tiny", 100)
    routed = 2 * 8 * 3 * 64 * 32
    whole, split = local_parameters(shape, 1), local_parameters(shape, 1, ep=2)
    assert whole.total == split.total + routed / 2 == count_parameters(shape)
    assert split.experts == routed / 2 and whole.experts == 0
    assert split.dense_total == count_parameters(shape) - routed
    active = count_parameters(shape) - 2 * (8 - 2) * 3 * 64 * 32  # all but the 6 experts a token skips
    assert whole.embedding + whole.blocks * whole.compute_per_block + whole.head == active
    assert split.compute_per_block == whole.compute_per_block
    cluster = _cluster()
    one, two = (project(Workload(shape=shape, layout=layout, precision="bf16", tokens_per_sample=SEQ_LEN,
                                 batch_size=BATCH), cluster, Placement(nodes=1, ranks_per_node=2, layout=layout))
                for layout in (Layout(ep_degree=1), Layout(ep_degree=2)))
    assert one.compute_s == pytest.approx(two.compute_s)  # EP moves tokens, not FLOPs
    assert two.moe_comm_s > one.moe_comm_s > 0  # all-to-alls beside the routing statistics' all-reduce
    assert two.expert_bytes_per_rank == 16 * routed / 2 and one.expert_bytes_per_rank == 0


def test_all_to_all_volume_and_time_by_hand():
    """Per MoE layer and micro-batch, each token's top-k copies go to their experts and come
    back, in forward and in backward (and once more when activation checkpointing
    recomputes); with even routing (ep-1)/ep of them leave the rank."""
    shape = model_shape("qwen3_moe_tiny", 100)
    workload = Workload(shape=shape, tokens_per_sample=SEQ_LEN, batch_size=BATCH)  # fp32: 4 bytes
    copies = BATCH * SEQ_LEN * 2 * 64 * 4  # tokens x top-2 x width x bytes
    assert all_to_all_bytes_per_micro(workload, Placement(1, 4, Layout(ep_degree=4))) == 2 * 4 * copies * 3 / 4
    checkpointed = dataclasses.replace(workload, layout=Layout(activation_checkpointing=True))
    assert all_to_all_bytes_per_micro(checkpointed, Placement(1, 4, Layout(ep_degree=4))) == 2 * 6 * copies * 3 / 4
    assert all_to_all_bytes_per_micro(workload, Placement(1, 4, Layout(ep_degree=1))) == 0
    # 8 ranks in a node, alpha 10 us, 100 GB/s: 7 steps + 7/8 of 1 MB.
    cluster = _cluster(intra=Link(10e-6, 100e9))
    assert all_to_all_time(1e6, Group(8, 1), cluster) == pytest.approx(7 * 10e-6 + 7 / 8 * 1e6 / 100e9)


def test_cli_projects_a_published_moe_layout(capsys, tmp_path):
    """Qwen3-30B-A3B on one p5.48xlarge, FSDP with expert parallel 8: the header states the
    active parameters, the experts each rank holds and the all-to-all volume, as the row
    does; the published config.json plans as the arch does."""
    from test_hf_moe import QWEN3_30B_A3B

    flags = ["--cluster", "p5.48xlarge", "--strategy", "fsdp", "--precision", "bf16", "--tokens-per-sample", "4096",
             "--batch-size", "2", "--activation-checkpointing", "--ep-degree", "8", "--json"]
    assert plan_cli.main(["--arch", "qwen3_moe_30b_a3b", *flags]) == 0
    printed = capsys.readouterr()
    row = json.loads(printed.out)[0]
    routed = 48 * 128 * 3 * 2048 * 768
    assert (row["ep_degree"], row["expert_bytes_per_rank"]) == (8, 16 * routed / 8)
    assert row["all_to_all_bytes"] == 48 * 6 * (2 * 4096 * 8 * 2048 * 2) * 7 / 8
    assert "3.353 B parameters active per token; --ep-degree 8: 54.00 GiB of experts per rank" in printed.err
    (tmp_path / "config.json").write_text(json.dumps(QWEN3_30B_A3B))
    assert plan_cli.main(["--arch", str(tmp_path / "config.json"), *flags]) == 0
    assert json.loads(capsys.readouterr().out)[0] == row


@pytest.mark.parametrize("arch, flags, message", [
    ("qwen3_moe_tiny", ["--ranks", "6", "--ep-degree", "4"], "--ep-degree 4 does not divide the 6 data-parallel ranks"),
    ("qwen3_moe_tiny", ["--ranks", "16", "--ep-degree", "16"], "--ep-degree 16 does not divide the 8 experts"),
    ("llama_tiny", ["--ranks", "2", "--ep-degree", "2"], "--ep-degree 2 splits the experts of MoE layers, and the "
                                                        "model has none"),
    ("qwen3_moe_tiny", ["--ranks", "2", "--tp-degree", "2"], "--tp-degree 2 with a mixture of experts is not offered"),
    ("qwen3_moe_tiny", ["--ranks", "2", "--ep-degree", "2", "--strategy", "zero1"],
     "--ep-degree 2 with --strategy zero1"),
    ("qwen3_moe_tiny", ["--ranks", "2", "--ep-degree", "0"], "--ep-degree must be at least 1, got 0"),
])
def test_cli_refuses_moe_layouts_distlm_train_refuses_in_one_line(arch, flags, message, capsys):
    assert plan_cli.main(["--arch", arch, "--cluster", "local", *flags]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("distlm.plan: error: " + message), lines
