"""Sharded strategies through the Trainer: same model as one process, and the memory they promise.

Each layout runs 5 updates of the same global batch as a single-process reference
computed here, and compares the weights exported from the checkpoint the run wrote.

Every multi-rank scenario of this module runs in one of two jobs spawned once per module
(one of 4 ranks, then one of 2), each scenario in turn with its own save directory; each
job returns per-scenario results (or the scenario's traceback), and the tests below assert
them one by one. Starting the processes and torch costs more here than the tiny models'
training, so one spawn per world size instead of one per scenario saves most of it.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors import safe_open

from distributed import Scenarios
from distlm.runtime import agreement
from distlm import checkpoint
from distlm.export import cli as export
from distlm.state.full import consolidated_parameters
from distlm.config import parse_args
from distlm.errors import UsageError
from distlm.training.memory import zero_formula_bytes
from distlm.training.trainer import Trainer
from test_ddp import PARAM_ATOL, UPDATES, assert_params_close, common_args, train

GLOBAL_BATCH = 8
# pytest.ini's 300 s per test bounds a hang; here the first test also waits for the module's
# two jobs (22 scenarios, about 2-3 minutes on 2 idle cores), so its bound is wider.
pytestmark = pytest.mark.timeout(900)


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


ARCHS = ("roberta_tiny", "llama_tiny")
MEMORY_STRATEGIES = ("ddp", "zero1", "fsdp")
MOVE_FIRST_UPDATES = 3  # under zero1 x tp2 on 4 ranks; the rest under fsdp on 2


def layout_args(data_dir: str, root: Path, case: str, arch: str) -> list[str]:
    strategy, tp, world_size, update_freq, extra = CASES[case]
    dp = world_size // tp
    saved = [a for a in common_args(data_dir, str(root / f"{case}-{arch}" / "run"), arch) if a != "--no-save"]
    return saved + ["--batch-size", str(GLOBAL_BATCH // dp // update_freq), "--update-freq", str(update_freq),
                    "--strategy", strategy, "--tp-degree", str(tp), "--check-replicas", *extra]


def move_args(data_dir: str, root: Path) -> list[str]:
    return [a for a in common_args(data_dir, str(root / "move"), "llama_tiny") if a != "--no-save"]


def resume_dropout_args(data_dir: str, root: Path) -> list[str]:
    args = [a for a in common_args(data_dir, str(root / "dropout"), "roberta_tiny") if a != "--no-save"]
    return args + ["--dropout", "0.1", "--attention-dropout", "0.1"]


def memory_args(data_dir: str, root: Path, strategy: str) -> list[str]:
    return common_args(data_dir, str(root / f"memory-{strategy}"), "llama_tiny") + [
        "--batch-size", "4", "--max-update", "2", "--strategy", strategy]


@pytest.fixture(scope="module")
def references(data_dir, tmp_path_factory) -> dict:
    """The single-process reference per architecture: 5 updates of the global batch.
    The same for every layout of one architecture (--no-save: the save dir is unused)."""
    root = tmp_path_factory.mktemp("reference")
    return {arch: train(common_args(data_dir, str(root), arch) + ["--batch-size", str(GLOBAL_BATCH)])
            for arch in ARCHS}


@pytest.fixture(scope="module")
def jobs(data_dir, tmp_path_factory) -> dict:
    """The module's two jobs: 4 ranks, then 2 (whose fsdp run resumes the 4-rank zero1 x tp2
    checkpoint): {"root": their directory, 4: Scenarios, 2: Scenarios}."""
    root = tmp_path_factory.mktemp("strategies")
    four = [(f"{case}-{arch}", train_and_export, (layout_args(data_dir, root, case, arch),
                                                    str(root / f"{case}-{arch}" / "model.safetensors")))
            for case in CASES if CASES[case][2] == 4 for arch in ARCHS]
    four.append(("move-zero1-tp2", resume_under, (move_args(data_dir, root) + [
        "--batch-size", str(GLOBAL_BATCH // 2), "--strategy", "zero1", "--tp-degree", "2"], MOVE_FIRST_UPDATES)))
    # Last: it makes rank 2's replica drift on purpose, and the run stops on every rank.
    four.append(("drift", _drift_on_rank_2, (common_args(data_dir, str(root / "drift"), "llama_tiny") + [
        "--batch-size", "4", "--tp-degree", "2", "--timeout-sec", "30"],)))

    # A node-local --save-dir: rank 0's holds a checkpoint, rank 1's (another node's disk) none.
    unseen = [a for a in common_args(data_dir, str(root / "unused"), "roberta_tiny") if a != "--no-save"]
    unseen += ["--batch-size", "4"]
    saver = Trainer(parse_args(unseen + ["--save-dir", str(root / "node0")]))
    saver.save_checkpoint()
    saver.checkpointer.close()  # gives up the save dir, as the end of fit does

    dropout = resume_dropout_args(data_dir, root)
    two = [(f"{case}-{arch}", train_and_export, (layout_args(data_dir, root, case, arch),
                                                   str(root / f"{case}-{arch}" / "model.safetensors")))
           for case in CASES if CASES[case][2] == 2 for arch in ARCHS]
    two += [
        ("move-fsdp", resume_under, (move_args(data_dir, root) + [
            "--batch-size", str(GLOBAL_BATCH // 2), "--strategy", "fsdp"], UPDATES - MOVE_FIRST_UPDATES)),
        ("dropout-dp2", resume_under, (dropout + ["--batch-size", "4"], 2)),
        ("dropout-tp2", resume_under, (dropout + ["--batch-size", "8", "--tp-degree", "2", "--check-replicas"], 2)),
        *[(f"memory-{strategy}", fit_and_report, (memory_args(data_dir, root, strategy),))
          for strategy in MEMORY_STRATEGIES],
        ("tp-probe", _tensor_parallel_probe, (common_args(data_dir, str(root / "probe"), "llama_tiny"),)),
        # Last: it widens agreement.PER_RANK for this process (put back after it).
        ("unseen-checkpoint", _trainer_error_with_save_dir_per_rank, (unseen, str(root))),
    ]
    # The 4-rank job first: the 2-rank fsdp run resumes its zero1 x tp2 checkpoint.
    return {"root": root, 4: Scenarios(4, four, timeout=900), 2: Scenarios(2, two, timeout=900)}


@pytest.mark.parametrize("arch", list(ARCHS))
@pytest.mark.parametrize("case", CASES)
def test_strategy_trains_like_one_process(case, arch, jobs, references):
    """5 updates of the same global batch as one process; the exported weights match it.

    Tolerance: the same as DDP's (PARAM_ATOL, see test_ddp.py): every combination computes
    the same gradients up to fp32 reassociation (half batches, sharded matmuls,
    all-reduced partial sums); measured differences are below 1e-6. --batch-size is per
    data-parallel replica: the tensor-parallel ranks of one replica see the same batch.
    Replicas must agree exactly: --check-replicas compares every copy bit for bit after
    every update (dp replicas, and whatever tensor parallel leaves whole on the tp ranks),
    and the consolidated weights are identical on every rank.
    """
    world_size = CASES[case][2]
    ranks = jobs[world_size][f"{case}-{arch}"]
    assert len(ranks) == world_size
    reference = references[arch]
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
    result = {"resumed_at": trainer.resumed_at, "params": consolidated_parameters(trainer.model)}
    trainer.checkpointer.close()  # gives up the save dir for the next run, as the end of fit does
    return result


def test_checkpoint_moves_between_strategies(jobs, references):
    """3 updates under zero1 x tp2 on 4 ranks, then 2 more under fsdp on 2 ranks from its
    checkpoint, match 5 single-process updates: the checkpoint holds whole, single-device
    named state (parameters and Adam moments), whatever sharded it (same tolerance as above)."""
    first = jobs[4]["move-zero1-tp2"]
    second = jobs[2]["move-fsdp"]
    assert first[0]["resumed_at"] is None and second[0]["resumed_at"] == MOVE_FIRST_UPDATES
    assert_params_close(second[0]["params"], references["llama_tiny"]["params"], PARAM_ATOL)


def test_resume_on_another_layout_seeds_dropout_by_replica(jobs):
    """Saved by 2 data-parallel ranks, resumed by the same 2 ranks as one tp2 replica, with
    dropout: each rank's saved RNG stream belongs to its old replica, so restoring it would
    give the two tp ranks of the new replica different masks where activations are
    replicated, and their copies of the replicated parameters would drift apart at once
    (--check-replicas compares them bit for bit after every update)."""
    first = jobs[2]["dropout-dp2"]
    second = jobs[2]["dropout-tp2"]
    assert first[0]["resumed_at"] is None and second[0]["resumed_at"] == 2


def test_a_checkpoint_only_some_ranks_see_is_refused_on_every_rank(jobs):
    """A node-local --save-dir: rank 0 finds checkpoint_last, rank 1 (another node's disk,
    here another directory) does not. Resuming on some ranks only would desynchronise their
    collectives (a hang), so both refuse with one line: the save dir's probe, before anything
    is read, finds that the ranks do not share one file system."""
    root = jobs["root"]
    errors = jobs[2]["unseen-checkpoint"]
    assert len(errors) == 2 and errors[0] == errors[1], errors  # one verdict, rank 0's save dir named
    error = errors[0]
    assert error.startswith(f"--save-dir {root}/node0 (other ranks were given {root}/node1): "), error
    assert "rank 1 (host " in error and "cannot read the file rank 0 wrote" in error, error
    assert "must be one file system" in error and "\n" not in error, error


def _trainer_error_with_save_dir_per_rank(args: list[str], root: str) -> str:
    rank = int(os.environ["RANK"])
    # Node-local disks share one path on a cluster; here they are directories of different
    # names, which the start-up agreement check would refuse before the save dir is looked at.
    per_rank = agreement.PER_RANK
    agreement.PER_RANK = per_rank | {"save_dir"}
    try:
        with pytest.raises(UsageError) as caught:
            Trainer(parse_args(args + ["--save-dir", f"{root}/node{rank}"]))
    finally:
        agreement.PER_RANK = per_rank
    return str(caught.value)


def test_a_drift_in_one_group_stops_every_rank(jobs):
    """dp2 x tp2: a shard that drifts on one data-parallel replica is seen only by the dp group
    holding it ({0, 2}), yet all 4 ranks must stop with --check-replicas, not leave ranks 1
    and 3 waiting in their next collective until the timeout."""
    messages = jobs[4]["drift"]
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


def test_tensor_parallel_gradients_and_replicated_copies(jobs):
    """On 2 tp ranks: only rank 0 builds the whole model; each rank holds gradients exactly
    the size of its parameter shards (the vocabulary-parallel embedding's included); and
    --check-replicas names a replicated parameter whose copies drift apart, but not a
    shard that differs."""
    results = jobs[2]["tp-probe"]
    # The model stayed on meta until sharded: only rank 0 ever built it whole (to broadcast it).
    assert [result["whole_models"] for result in results] == [1, 0]
    for result in results:
        assert result["memory"]["grad_bytes"] == result["memory"]["param_bytes"], result["memory"]
        assert result["drift"] == ("tensor-parallel", "norm.weight")


def _tensor_parallel_probe(args: list[str]) -> dict:
    import distlm.training.builder

    whole_models = []
    initialise = distlm.training.builder._initialised

    def counted(model, device, *args):
        whole_models.append(device)
        return initialise(model, device, *args)

    distlm.training.builder._initialised = counted
    try:
        trainer = Trainer(parse_args(args + ["--batch-size", "4", "--tp-degree", "2", "--log-interval", "1"]))
    finally:
        distlm.training.builder._initialised = initialise
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


@pytest.mark.parametrize("strategy", MEMORY_STRATEGIES)
def test_memory_per_rank_matches_the_zero_formulas(data_dir, tmp_path, strategy, jobs):
    """fp32 Adam: DDP 16 psi per rank, ZeRO-1 optimizer state 8 psi / N, FSDP total 16 psi / N."""
    psi = single_device_parameter_count(memory_args(data_dir, tmp_path, strategy))
    reports = jobs[2][f"memory-{strategy}"][0]
    stage = {"ddp": 0, "zero1": 1, "fsdp": 3}[strategy]
    formula = zero_formula_bytes(psi, dp=2, stage=stage)
    assert reports
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
