"""Expert parallelism through the Trainer trains the same mixture of experts as one process.

Each layout runs UPDATES updates of the same global batch as a single-process reference
computed here, and compares the consolidated parameters, the gradient norms and the
routing statistics of the train line (aux loss, load imbalance, dropped tokens). Two
router setups cover both router kinds, shared experts, the aux loss and the aux-loss-free
bias update without running every combination:

- ``softmax``: Qwen3-MoE's router, the aux loss;
- ``sigmoid``: DeepSeek-V3's router with its bias update, a shared expert, the aux loss.

The 2-rank runs share one job and the 4-rank runs another (starting processes dominates
the time on this 2-core machine). The checkpoint of the 2-rank EP 2 run is resumed by
one process, whose checkpoint is resumed by EP 4 on 4 ranks: experts are saved under
single-device names, so each move reloads exactly the parameters saved.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from safetensors.torch import load_file

from distributed import Scenarios
from distlm.export import cli as export
from distlm.config import parse_args
from distlm.models.moe.model import moe_layers
from distlm.state.full import consolidated_parameters
from distlm.training.trainer import Trainer
from test_ddp import assert_params_close, common_args

UPDATES = 3
GLOBAL_BATCH = 8
ROUTERS = {
    # A coefficient far above a real run's (0.001-0.02) so that the aux loss moves the router
    # enough for a wrong average to show through Adam after 3 updates.
    "softmax": ["--moe-aux-loss-coef", "0.1"],
    "sigmoid": ["--moe-router", "sigmoid", "--moe-bias-update-rate", "0.01", "--moe-shared-experts", "1",
                "--moe-aux-loss-coef", "0.1"],
}
# Tolerance: as test_ddp's PARAM_ATOL argues, only fp32 reassociation separates the layouts
# (each expert's rows multiplied in other batches, gradients summed over ranks, over the
# expert dimension through the all-to-all's backward), amplified at most lr * dg / eps by
# Adam; measured differences after 3 updates are 2e-7 to 8e-7. A wrong gradient scale, an aux loss
# over the wrong tokens or experts' gradients summed over the wrong ranks move some
# parameter by ~lr (1e-3) per update (the sabotaged runs below end 4.5e-3 to 4.9e-3 off).
PARAM_ATOL = 5e-6
pytestmark = pytest.mark.timeout(900)


def args_for(data_dir: str, save_dir: Path, router: str, world_size: int, *extra: str) -> list[str]:
    saved = [a for a in common_args(data_dir, str(save_dir), "qwen3_moe_tiny") if a != "--no-save"]
    return saved + ["--batch-size", str(GLOBAL_BATCH // world_size), *ROUTERS[router], *extra]


def train(args: list[str], updates: int = UPDATES, sabotage=None, keep_at: tuple[int, ...] = ()) -> dict:
    """``updates`` updates (``sabotage(trainer)`` first, if given), then a checkpoint; the
    consolidated parameters after loading and at the end (and after each update in
    ``keep_at``), and each update's logged numbers."""
    trainer = Trainer(parse_args(args))
    if sabotage is not None:
        sabotage(trainer)
    result = {"resumed_at": trainer.resumed_at, "initial": consolidated_parameters(trainer.model), "records": []}
    batches = trainer.update_batches()
    for update in range(1, updates + 1):
        record = trainer.train_step(next(batches))
        result["records"].append({key: record[key] for key in ("gnorm", "aux_loss", "load_imbalance",
                                                               "dropped_tokens")})
        if update in keep_at:
            result[update] = consolidated_parameters(trainer.model)
    trainer.save_checkpoint()
    trainer.checkpointer.close()  # gives up the save dir for the next run, as the end of fit does
    result["params"] = consolidated_parameters(trainer.model)
    return result


def statistics_over_local_batch(trainer: Trainer) -> None:
    """The mistake of averaging the aux loss (and the routing counts) over each rank's own batch."""
    for layer in moe_layers(trainer.model):
        layer.reduce_statistics = None


def experts_reduced_over_their_own_group(trainer: Trainer) -> None:
    """The mistake of summing the experts' gradients over the expert-parallel group (ranks holding
    other experts) instead of the ranks holding the same experts."""
    trainer.handle.expert_gradients.group = trainer.ctx.dims.ep_mesh("cpu")["ep"].get_group()


@pytest.fixture(scope="module")
def references(data_dir, tmp_path_factory) -> dict:
    """One process, the global batch, per router setup; the softmax one runs on to update 5,
    where the checkpoint chain below ends."""
    root = tmp_path_factory.mktemp("reference")
    return {"softmax": train(args_for(data_dir, root / "softmax", "softmax", 1), updates=5, keep_at=(UPDATES,)),
            "sigmoid": train(args_for(data_dir, root / "sigmoid", "sigmoid", 1))}


@pytest.fixture(scope="module")
def jobs(data_dir, tmp_path_factory) -> dict:
    """2 ranks (EP 2: both setups; FSDP 2 without expert parallel; the local-aux mistake), then one process resuming EP 2's
    checkpoint for one update, then 4 ranks (EP 2 x FSDP 2, EP 2 x DDP 2, the wrong-group
    mistake, and EP 4 resuming the one process's checkpoint for one more update)."""
    root = tmp_path_factory.mktemp("expert_parallel")
    chain = root / "chain"
    two = Scenarios(2, [
        ("ep2-softmax", train, (args_for(data_dir, chain, "softmax", 2, "--ep-degree", "2"),)),
        ("ep2-sigmoid", train, (args_for(data_dir, root / "ep2-sigmoid", "sigmoid", 2, "--ep-degree", "2"),)),
        ("fsdp2-softmax", train, (args_for(data_dir, root / "fsdp2", "softmax", 2, "--strategy", "fsdp"),)),
        ("local-aux", train, (args_for(data_dir, root / "local-aux", "softmax", 2, "--ep-degree", "2"), UPDATES,
                              statistics_over_local_batch)),
    ], timeout=600)
    one = train(args_for(data_dir, chain, "softmax", 1), updates=1) if (chain / "checkpoint_last").exists() else None
    four = Scenarios(4, [
        ("ep2-fsdp2-softmax", train, (args_for(data_dir, root / "fsdp", "softmax", 4, "--ep-degree", "2",
                                               "--strategy", "fsdp"),)),
        ("ep2-ddp2-sigmoid", train, (args_for(data_dir, root / "ddp", "sigmoid", 4, "--ep-degree", "2",
                                              "--check-replicas"),)),
        ("wrong-group", train, (args_for(data_dir, root / "wrong", "softmax", 4, "--ep-degree", "2"), UPDATES,
                                experts_reduced_over_their_own_group)),
        ("ep4-resume", train, (args_for(data_dir, chain, "softmax", 4, "--ep-degree", "4"), 1)),
    ], timeout=900)
    return {2: two, 1: one, 4: four, "chain": chain}


def after_updates(reference: dict) -> dict:
    """The reference's parameters after UPDATES updates."""
    return reference.get(UPDATES, reference["params"])


def max_difference(params: dict, reference: dict) -> float:
    return max(float((params[name] - reference[name]).abs().max()) for name in reference)


@pytest.mark.parametrize("case, world_size, router", [
    ("ep2-softmax", 2, "softmax"), ("ep2-sigmoid", 2, "sigmoid"), ("fsdp2-softmax", 2, "softmax"),
    ("ep2-fsdp2-softmax", 4, "softmax"), ("ep2-ddp2-sigmoid", 4, "sigmoid"),
])
def test_expert_parallel_trains_like_one_process(case, world_size, router, jobs, references):
    """EP 2 on 2 ranks, EP 2 x FSDP 2 and EP 2 x DDP 2 (whose experts' gradients are summed over
    2 replicas; --check-replicas compares those copies bit for bit after every update) on 4; and
    FSDP 2 without expert parallel, whose routing statistics are summed over its 2 ranks alone."""
    ranks = jobs[world_size][case]
    reference = references[router]
    assert_params_close(ranks[0]["params"], after_updates(reference), PARAM_ATOL)
    # The train line's numbers: global statistics, as one process counts them. The loads are
    # integer counts (exact); the aux loss sums router probabilities in another order.
    for mine, theirs in zip(ranks[0]["records"], reference["records"]):
        np.testing.assert_allclose(mine["gnorm"], theirs["gnorm"], rtol=1e-5)
        np.testing.assert_allclose(mine["aux_loss"], theirs["aux_loss"], rtol=1e-5)
        assert mine["load_imbalance"] == theirs["load_imbalance"]
        assert mine["dropped_tokens"] == theirs["dropped_tokens"] == 0
    for result in ranks[1:]:
        assert result["records"] == ranks[0]["records"]
        assert all(torch.equal(result["params"][name], value) for name, value in ranks[0]["params"].items())


@pytest.mark.parametrize("case, ranks", [("local-aux", 2), ("wrong-group", 4)])
def test_the_comparison_sees_a_wrong_average(case, ranks, jobs, references):
    """The same runs with one mistake each end far outside the tolerance: the aux loss and routing
    counts of each rank's own batch, or the experts' gradients summed over the ranks holding other
    experts."""
    result = jobs[ranks][case][0]
    assert max_difference(result["params"], after_updates(references["softmax"])) > 20 * PARAM_ATOL
    if case == "local-aux":
        assert [r["aux_loss"] for r in result["records"]] != [r["aux_loss"] for r in references["softmax"]["records"]]


def test_checkpoints_reshard_between_expert_parallel_degrees_exactly(jobs, references):
    """EP 2 saves after 3 updates; one process loads exactly those parameters and saves after
    a 4th; EP 4 loads exactly those and makes a 5th, which matches 5 single-process updates
    (Adam's moments and the data position moved with the weights)."""
    ep2, one, ep4 = jobs[2]["ep2-softmax"][0], jobs[1], jobs[4]["ep4-resume"]
    assert one is not None, "EP 2 wrote no checkpoint"
    assert one["resumed_at"] == UPDATES and ep4[0]["resumed_at"] == UPDATES + 1
    for name, value in ep2["params"].items():
        assert torch.equal(one["initial"][name], value), name
    for rank in ep4:
        for name, value in one["params"].items():
            assert torch.equal(rank["initial"][name], value), name
    assert_params_close(ep4[0]["params"], references["softmax"]["params"], PARAM_ATOL)


def test_an_expert_parallel_checkpoint_exports_whole_experts(jobs, tmp_path):
    """EP 4's last checkpoint, exported by one process, holds every expert tensor whole under its
    single-device name ([experts, ...], no rank in the name), equal to the trained weights."""
    exported = load_file(str(export.export(str(jobs["chain"] / "checkpoint_last"), str(tmp_path / "model.safetensors"))))
    trained = jobs[4]["ep4-resume"][0]["params"]
    assert exported.keys() == trained.keys()
    assert exported["layers.0.feed_forward.experts.gate_up_proj"].shape[0] == 8
    assert all(torch.equal(exported[name], value) for name, value in trained.items())
