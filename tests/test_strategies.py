"""Sharded strategies through the Trainer: same model as one process, and the memory they promise.

Each test runs 5 updates of the same global batch as a single-process reference
computed here, and compares the weights exported from the checkpoint the run wrote.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors import safe_open

from distributed import run_distributed
from distlm import agreement, checkpoint, export
from distlm.parallel.full_state import consolidated_parameters
from distlm.config import parse_args
from distlm.errors import UsageError
from distlm.memory import zero_formula_bytes
from distlm.trainer import Trainer
from test_ddp import PARAM_ATOL, UPDATES, assert_params_close, common_args, train

GLOBAL_BATCH = 8


def train_and_export(args: list[str], export_to: str) -> dict:
    """Train, write a checkpoint, and on rank 0 export it: the weights a user would take away."""
    trainer = Trainer(parse_args(args))
    batches = trainer.update_batches()
    gnorms = [trainer.train_step(next(batches))["gnorm"] for _ in range(UPDATES)]
    trainer.save_checkpoint()  # collective: gathers every shard (and ZeRO-1's optimizer partitions)
    result = {"gnorms": gnorms, "params": consolidated_parameters(trainer.model)}
    if trainer.ctx.is_main:
        export.export(str(Path(trainer.config.checkpoint.save_dir) / checkpoint.LAST), export_to)
        with safe_open(export_to, "pt") as exported:
            aliases = json.loads(exported.metadata()["tied_weights"])
            weights = {name: exported.get_tensor(name) for name in exported.keys()}
        result["exported"] = {**weights, **{alias: weights[target] for alias, target in aliases.items()}}
    return result


# (strategy, tp degree, world size, micro-batches per update, extra flags). The flags
# alternate so that tensor parallel runs with and without sequence shards, one case runs
# the whole fixed order (tensor parallel, then activation checkpointing, then FSDP), and
# gradient accumulation skips the reduction on the first micro-batch under both FSDP and
# replicate (the data parallelism of tensor-parallel DDP).
CASES = {
    "fsdp-accumulating": ("fsdp", 1, 2, 2, []),
    "zero1": ("zero1", 1, 2, 1, []),
    "ddp-tp2": ("ddp", 2, 2, 1, []),
    "ddp2-tp2-sp-accumulating": ("ddp", 2, 4, 2, ["--sequence-parallel"]),
    "fsdp-tp2-sp-ac": ("fsdp", 2, 4, 1, ["--sequence-parallel", "--activation-checkpointing"]),
    "zero1-tp2": ("zero1", 2, 4, 1, []),
}


@pytest.mark.parametrize("arch", ["roberta_tiny", "llama_tiny"])
@pytest.mark.parametrize("case", CASES)
def test_strategy_trains_like_one_process(data_dir, tmp_path, case, arch):
    """5 updates of the same global batch as one process; the exported weights match it.

    Tolerance: the same as DDP's (PARAM_ATOL, see test_ddp.py): every combination computes
    the same gradients up to fp32 reassociation (half batches, sharded matmuls,
    all-reduced partial sums); measured differences are below 1e-6. --batch-size is per
    data-parallel replica: the tensor-parallel ranks of one replica see the same batch.
    Replicas must agree exactly: --check-replicas compares every copy bit for bit after
    every update (dp replicas, and whatever tensor parallel leaves whole on the tp ranks),
    and the consolidated weights are identical on every rank.
    """
    strategy, tp, world_size, update_freq, extra = CASES[case]
    args = common_args(data_dir, str(tmp_path / "reference"), arch)
    reference = train(args + ["--batch-size", str(GLOBAL_BATCH)])
    dp = world_size // tp
    saved = [a for a in common_args(data_dir, str(tmp_path / "run"), arch) if a != "--no-save"]
    ranks = run_distributed(
        train_and_export, world_size,
        saved + ["--batch-size", str(GLOBAL_BATCH // dp // update_freq), "--update-freq", str(update_freq),
                 "--strategy", strategy, "--tp-degree", str(tp), "--check-replicas", *extra],
        str(tmp_path / "model.safetensors"),
        timeout=300,
    )
    assert_params_close(ranks[0]["exported"], reference["params"], PARAM_ATOL)
    np.testing.assert_allclose(ranks[0]["gnorms"], reference["gnorms"], rtol=1e-5)
    for result in ranks[1:]:
        assert result["gnorms"] == ranks[0]["gnorms"]
        for name, value in ranks[0]["params"].items():
            assert torch.equal(result["params"][name], value), name


def resume_under(args: list[str], updates: int) -> dict:
    trainer = Trainer(parse_args(args))
    batches = trainer.update_batches()
    for _ in range(updates):
        trainer.train_step(next(batches))
    trainer.save_checkpoint()
    return {"resumed_at": trainer.resumed_at,
            "params": consolidated_parameters(trainer.model)}


def test_checkpoint_moves_between_strategies(data_dir, tmp_path):
    """3 updates under zero1 x tp2 on 4 ranks, then 2 more under fsdp on 2 ranks from its
    checkpoint, match 5 single-process updates: the checkpoint holds whole, single-device
    named state (parameters and Adam moments), whatever sharded it (same tolerance as above)."""
    args = common_args(data_dir, str(tmp_path / "reference"), "llama_tiny")
    reference = train(args + ["--batch-size", str(GLOBAL_BATCH)])
    saved = [a for a in common_args(data_dir, str(tmp_path / "run"), "llama_tiny") if a != "--no-save"]
    first = run_distributed(resume_under, 4, saved + ["--batch-size", str(GLOBAL_BATCH // 2), "--strategy", "zero1",
                                                       "--tp-degree", "2"], 3, timeout=300)
    second = run_distributed(resume_under, 2, saved + ["--batch-size", str(GLOBAL_BATCH // 2), "--strategy", "fsdp"],
                             UPDATES - 3, timeout=300)
    assert first[0]["resumed_at"] is None and second[0]["resumed_at"] == 3
    assert_params_close(second[0]["params"], reference["params"], PARAM_ATOL)


def test_resume_on_another_layout_seeds_dropout_by_replica(data_dir, tmp_path):
    """Saved by 2 data-parallel ranks, resumed by the same 2 ranks as one tp2 replica, with
    dropout: each rank's saved RNG stream belongs to its old replica, so restoring it would
    give the two tp ranks of the new replica different masks where activations are
    replicated, and their copies of the replicated parameters would drift apart at once
    (--check-replicas compares them bit for bit after every update)."""
    args = [a for a in common_args(data_dir, str(tmp_path), "roberta_tiny") if a != "--no-save"]
    args += ["--dropout", "0.1", "--attention-dropout", "0.1"]
    first = run_distributed(resume_under, 2, args + ["--batch-size", "4"], 2)
    second = run_distributed(resume_under, 2, args + ["--batch-size", "8", "--tp-degree", "2", "--check-replicas"], 2)
    assert first[0]["resumed_at"] is None and second[0]["resumed_at"] == 2


def test_a_checkpoint_only_some_ranks_see_is_refused_on_every_rank(data_dir, tmp_path):
    """A node-local --save-dir: rank 0 finds checkpoint_last, rank 1 (another node's disk,
    here another directory) does not. Resuming on some ranks only would desynchronise their
    collectives (a hang), so both refuse with the same one-line error."""
    base = [a for a in common_args(data_dir, str(tmp_path / "unused"), "roberta_tiny") if a != "--no-save"]
    base += ["--batch-size", "4"]
    saver = Trainer(parse_args(base + ["--save-dir", str(tmp_path / "node0")]))
    saver.save_checkpoint()
    saver.checkpointer.close()  # gives up the save dir, as the end of fit does
    errors = run_distributed(_trainer_error_with_save_dir_per_rank, 2, base, str(tmp_path))
    for rank, error in enumerate(errors):
        assert error.startswith(f"--save-dir {tmp_path}/node{rank}: checkpoint_last is there on ranks [0] only;"), error


def _trainer_error_with_save_dir_per_rank(args: list[str], root: str) -> str:
    rank = int(os.environ["RANK"])
    # Node-local disks share one path on a cluster; here they are directories of different
    # names, which the start-up agreement check would refuse before the save dir is looked at.
    agreement.PER_RANK = agreement.PER_RANK | {"save_dir"}
    with pytest.raises(UsageError) as caught:
        Trainer(parse_args(args + ["--save-dir", f"{root}/node{rank}"]))
    return str(caught.value)


def test_a_drift_in_one_group_stops_every_rank(data_dir, tmp_path):
    """dp2 x tp2: a shard that drifts on one data-parallel replica is seen only by the dp group
    holding it ({0, 2}), yet all 4 ranks must stop with --check-replicas, not leave ranks 1
    and 3 waiting in their next collective until the timeout."""
    args = common_args(data_dir, str(tmp_path), "llama_tiny") + ["--batch-size", "4", "--tp-degree", "2",
                                                                   "--timeout-sec", "30"]
    messages = run_distributed(_drift_on_rank_2, 4, args, timeout=120)
    assert all(m.startswith("--check-replicas: after update 1, ") for m in messages), messages
    assert "layers.0.attention.wq.weight differs between data-parallel ranks 0 and 2" in messages[0]
    assert messages[0] == messages[2] and messages[1] == messages[3] != messages[0]


def _drift_on_rank_2(args: list[str]) -> str:
    trainer = Trainer(parse_args(args))
    trainer.train_step(next(trainer.update_batches()))
    if trainer.ctx.rank == 2:
        with torch.no_grad():
            trainer.model.layers[0].attention.wq.weight.to_local().add_(1.0)
    with pytest.raises(RuntimeError, match="--check-replicas") as caught:
        trainer.check_replicas()
    return str(caught.value)


def test_tensor_parallel_gradients_and_replicated_copies(data_dir, tmp_path):
    """On 2 tp ranks: only rank 0 builds the whole model; each rank holds gradients exactly
    the size of its parameter shards (the vocabulary-parallel embedding's included); and
    --check-replicas names a replicated parameter whose copies drift apart, but not a
    shard that differs."""
    results = run_distributed(_tensor_parallel_probe, 2, common_args(data_dir, str(tmp_path), "llama_tiny"))
    # The model stayed on meta until sharded: only rank 0 ever built it whole (to broadcast it).
    assert [result["whole_models"] for result in results] == [1, 0]
    for result in results:
        assert result["memory"]["grad_bytes"] == result["memory"]["param_bytes"], result["memory"]
        assert result["drift"] == ("tensor-parallel", "norm.weight")


def _tensor_parallel_probe(args: list[str]) -> dict:
    import distlm.builder

    whole_models = []
    initialise = distlm.builder._initialised

    def counted(model, device, *args):
        whole_models.append(device)
        return initialise(model, device, *args)

    distlm.builder._initialised = counted
    trainer = Trainer(parse_args(args + ["--batch-size", "4", "--tp-degree", "2", "--log-interval", "1"]))
    trainer.train_step(next(trainer.update_batches()))
    model = trainer.model
    with torch.no_grad():
        if trainer.ctx.rank == 1:
            # Shards differ by design: a change to one rank's shard of wq is not a replica drifting.
            model.layers[0].attention.wq.weight.to_local().add_(1.0)
        trainer.check_replicas()
        if trainer.ctx.rank == 1:
            model.norm.weight.add_(1e-7)  # a replicated norm: every tp rank must hold the same bits
    with pytest.raises(RuntimeError, match="--check-replicas") as caught:
        trainer.check_replicas()
    message = str(caught.value)
    drift = message.split(" ranks ")[0].split("between ")[1], message.split("parameter ")[1].split(" ")[0]
    return {"memory": trainer.last_memory, "drift": drift, "whole_models": len(whole_models)}


def fit_and_report(args: list[str]) -> dict:
    trainer = Trainer(parse_args(args))
    return trainer.fit()["memory_bytes_per_rank"]


def single_device_parameter_count(args: list[str]) -> int:
    trainer = Trainer(parse_args(args + ["--max-update", "1"]))
    return sum(t.numel() for t in consolidated_parameters(trainer.model).values())


@pytest.mark.parametrize("strategy", ["ddp", "zero1", "fsdp"])
def test_memory_per_rank_matches_the_zero_formulas(data_dir, tmp_path, strategy):
    """fp32 Adam: DDP 16 psi per rank, ZeRO-1 optimizer state 8 psi / N, FSDP total 16 psi / N."""
    args = common_args(data_dir, str(tmp_path), "llama_tiny") + ["--batch-size", "4", "--max-update", "2",
                                                                   "--strategy", strategy]
    psi = single_device_parameter_count(args)
    reports = run_distributed(fit_and_report, 2, args)[0]
    stage = {"ddp": 0, "zero1": 1, "fsdp": 3}[strategy]
    formula = zero_formula_bytes(psi, dp=2, stage=stage)
    for report in reports:
        measured = report["optimizer_bytes"] if strategy == "zero1" else report["total_bytes"]
        expected = formula["optimizer_bytes"] if strategy == "zero1" else formula["total_bytes"]
        # Measured from the local tensors, so it differs from the formula only by what the
        # formula leaves out: Adam's 4-byte step counter per tensor, FSDP's padding of
        # uneven shards to ceil(rows / N), and ZeRO-1's whole-tensor partitions (a rank can
        # hold up to (1 - 1/N) x its largest tensor's state more than 8 psi / N). For
        # llama_tiny each of these is below 2 % of the total.
        assert abs(measured - expected) / expected < 0.02, (strategy, measured, expected)


def test_memory_is_reported_when_an_epoch_ends_the_run(data_dir, tmp_path):
    """A run bounded by --max-epoch, shorter than --log-interval, still measures its last update."""
    args = common_args(data_dir, str(tmp_path), "llama_tiny") + ["--batch-size", "64", "--max-update", "0",
                                                                   "--max-epoch", "1"]
    trainer = Trainer(parse_args(args))
    [report] = trainer.fit()["memory_bytes_per_rank"]
    psi = sum(p.numel() for p in trainer.model.parameters())
    assert report["param_bytes"] == report["grad_bytes"] == 4 * psi, report
    assert report["optimizer_bytes"] >= 8 * psi


@pytest.mark.parametrize("arch", ["roberta_tiny", "llama_tiny"])
def test_activation_checkpointing_recomputes_the_same_training(data_dir, tmp_path, arch):
    """Recomputing activations in backward changes memory, not arithmetic: with dropout 0 the
    recomputed forward is the same sequence of CPU kernels, so training is bit-identical,
    and the checkpoint/export names stay the single-device ones."""
    args = common_args(data_dir, str(tmp_path), arch) + ["--batch-size", "4"]
    plain = train(args)
    recomputed = train(args + ["--activation-checkpointing"])
    assert recomputed["params"].keys() == plain["params"].keys()
    for name, value in plain["params"].items():
        assert (recomputed["params"][name] == value).all(), name
    assert recomputed["gnorms"] == plain["gnorms"]


def saved_activation_bytes(args: list[str]) -> int:
    """Bytes autograd keeps for backward after one forward of the Trainer's model."""
    trainer = Trainer(parse_args(args))
    input_ids = next(trainer.update_batches())[0]["input_ids"].to(trainer.ctx.device)
    saved = 0

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        nonlocal saved
        saved += tensor.numel() * tensor.element_size()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        trainer.model(input_ids)
    return saved


@pytest.mark.parametrize("arch", ["roberta_tiny", "llama_tiny"])
def test_activation_checkpointing_keeps_less_for_backward(data_dir, tmp_path, arch):
    """The flag really recomputes: the blocks' activations are not kept (their inputs are),
    so far less is saved (weights count alike in both)."""
    args = common_args(data_dir, str(tmp_path), arch) + ["--batch-size", "4"]
    plain, recomputed = saved_activation_bytes(args), saved_activation_bytes(args + ["--activation-checkpointing"])
    assert recomputed < 0.5 * plain, (recomputed, plain)
