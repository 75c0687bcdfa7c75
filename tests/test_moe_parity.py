"""A mixture of experts under the parity tool and ``--check-replicas``: ``ep=N`` in a layout,
a divergence named down to the expert, the aux loss's reference, and expert replicas
compared bit for bit.

One parity run (EP 2 with an aux loss, two updates, one of rank 1's experts moved before
the second) serves the assertions about results; one 4-rank job (EP 2 x DDP 2, whose
experts each live on two ranks) the ones about replicas.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from distributed import Scenarios
from distlm.config import parse_args
from distlm.errors import UsageError
from distlm.models.moe.model import moe_layers
from distlm.state.names import parameter_names
from distlm.parallel.replicas import ReplicaDrift
from distlm.parity.__main__ import main
from distlm.parity.compare import StepComparison, Tolerance, expert_slices, first_divergence
from distlm.parity.layouts import parse_layout
from distlm.parity.worker import PERTURB_VARIABLE
from distlm.training.trainer import Trainer
from test_ddp import common_args

LAYOUT = "ep=2"
# Before update 2, rank 1 (experts 4-7 of 8) moves its shard of the second layer's experts'
# down projections by 0.01, a third of those weights' largest magnitude: a broken expert.
EXPERT = "layers.1.feed_forward.experts.down_proj"
PERTURB = f"ep-2:2:{EXPERT}:1:0.01"
RUN = ["--steps", "2", "--activations", "--arch", "qwen3_moe_tiny", "--moe-aux-loss-coef", "0.01", "--device", "cpu",
       "--batch-size", "2", "--tokens-per-sample", "16"]


@pytest.fixture(scope="module")
def parity(data_dir, tmp_path_factory) -> tuple[int, dict, Path]:
    out = tmp_path_factory.mktemp("moe_parity")
    saved = os.environ.get(PERTURB_VARIABLE)
    os.environ[PERTURB_VARIABLE] = PERTURB
    try:
        status = main(["--layouts", LAYOUT, *RUN, "--data", data_dir, "--out", str(out)])
    finally:
        if saved is None:
            os.environ.pop(PERTURB_VARIABLE, None)
        else:
            os.environ[PERTURB_VARIABLE] = saved
    return status, json.loads((out / "parity.json").read_text())["layouts"][0], out


def test_an_expert_parallel_layout_equals_one_process_until_an_expert_breaks(parity):
    """Update 1, before the perturbation: every output and input gradient, the loss, the
    gradient norm and every parameter, each expert on its own, within the tolerance. The
    reference took the global batch as one micro-batch of 2 x 2 samples: the aux loss is
    that of the global micro-batch."""
    status, result, out = parity
    assert parse_layout(LAYOUT).world_size == 2 and result["flags"] == ["--ep-degree", "2"]
    reference = json.loads((out / "reference" / "spec.json").read_text())["flags"]
    assert reference[-4:] == ["--batch-size", "4", "--update-freq", "1"]
    step1 = result["steps"][1]
    tolerance = result["tolerance"]
    assert step1["loss_difference"] <= tolerance and step1["gnorm_difference"] <= tolerance
    assert max(step1["activations"].values()) <= tolerance
    assert {f"{EXPERT}[expert {expert}]" for expert in range(8)} <= set(step1["parameters"])
    assert EXPERT not in step1["parameters"]  # compared expert by expert, not as one tensor
    assert all(diff <= tolerance + step1["parameter_slack"][name] for name, diff in step1["parameters"].items())


def test_the_report_names_the_broken_expert(parity):
    """Update 2 meets rank 1's moved experts: the second block's output differs first. Every
    parameter then takes another update, but rank 1's experts of that tensor, named one by
    one, differ a hundred times more than any other parameter (rank 0's experts of the same
    tensor included), and the table names the worst of them."""
    status, result, out = parity
    assert status == 1 and not result["equal"]
    assert result["first_difference"].startswith("step 2: forward output of layers.1 differs by")
    params = result["steps"][2]["parameters"]
    moved = {f"{EXPERT}[expert {expert}]" for expert in range(4, 8)}
    assert min(params[name] for name in moved) > 100 * max(diff for name, diff in params.items() if name not in moved)
    largest = max(params, key=params.__getitem__)
    assert largest in moved and f"| {LAYOUT} | 2 |" in (table := (out / "parity.md").read_text())
    assert f"({largest})" in table


def test_a_loss_or_gradient_norm_difference_names_the_parameter_that_moved_most():
    """Without recorded activations the first difference is the loss or gradient norm; the
    report then adds which parameter, down to the expert, differs most after that update."""
    tolerance = Tolerance(1e-4, "test", 0.0)
    params = {"layers.0.attention.wq.weight": 5e-5, f"{EXPERT}[expert 2]": 3e-3, f"{EXPERT}[expert 6]": 7e-2}
    row = StepComparison(1, 1.0, 1.0, 0.0, 2e-3, params, {name: 0.0 for name in params})
    assert first_divergence([row], tolerance) == ("step 1: the gradient norm differs by 2.00e-03; "
                                                  f"parameter {EXPERT}[expert 6] differs most after it, by 7.00e-02")
    quiet = StepComparison(1, 1.0, 1.0, 0.0, 2e-3, {"norm.weight": 0.0}, {"norm.weight": 0.0})
    assert first_divergence([quiet], tolerance) == "step 1: the gradient norm differs by 2.00e-03"
    stacked = expert_slices({EXPERT: torch.arange(24.0).view(3, 2, 4), "norm.weight": torch.ones(4)})
    assert list(stacked) == [f"{EXPERT}[expert 0]", f"{EXPERT}[expert 1]", f"{EXPERT}[expert 2]", "norm.weight"]
    assert torch.equal(stacked[f"{EXPERT}[expert 2]"], torch.arange(16.0, 24.0).view(2, 4))


def test_layouts_whose_reference_cannot_exist_are_refused_in_one_line(data_dir, tmp_path, capsys):
    """ep divides the data-parallel ranks; with an aux loss, a global micro-batch of several
    update_freq micro-batches per rank has no one-process counterpart."""
    with pytest.raises(UsageError, match="ep=2 does not divide the 3 data-parallel ranks"):
        parse_layout("ep=2,dp=3")
    assert main(["--layouts", "ep=2,update_freq=2", *RUN, "--data", data_dir, "--out", str(tmp_path / "out")]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and "aux loss is taken over each global micro-batch" in lines[0], lines
    assert "--update-freq 2" in lines[0] and not (tmp_path / "out").exists()


# ------------------------------------------------------------------------ replicas


def break_expert_replicas(args: list[str]) -> dict:
    """One update of EP 2 x DDP 2 under --check-replicas (the check runs after it), then one
    rank at a time moves one element of its experts, or of a dense weight, and every rank
    checks: what each reported (None: the check passed)."""
    trainer = Trainer(parse_args(args))
    trainer.train_step(next(trainer.update_batches()))
    experts = moe_layers(trainer.model)[1].experts.down_proj
    dense = dict(zip(parameter_names(trainer.model), trainer.model.parameters()))["layers.1.attention.wq.weight"]
    reports = {}
    for what, param, rank in (("experts", experts, 2), ("experts", experts, 3), ("dense", dense, 1)):
        local = param.to_local() if hasattr(param, "to_local") else param
        with torch.no_grad():
            if dist.get_rank() == rank:
                local.view(-1)[5] += 1e-3
            try:
                trainer.check_replicas()
                reports[what, rank] = None
            except ReplicaDrift as drift:
                reports[what, rank] = str(drift)
            if dist.get_rank() == rank:
                local.view(-1)[5] -= 1e-3
    return reports


@pytest.fixture(scope="module")
def replicas(data_dir, tmp_path_factory) -> list[dict]:
    args = common_args(data_dir, str(tmp_path_factory.mktemp("replicas")), "qwen3_moe_tiny")
    args += ["--batch-size", "2", "--ep-degree", "2", "--check-replicas"]
    return Scenarios(4, [("break", break_expert_replicas, (args,))], timeout=400)["break"]


def test_check_replicas_compares_each_expert_with_its_replica(replicas):
    """Ranks 0 and 2 hold experts 0-3, ranks 1 and 3 experts 4-7: a drift on rank 2 is named
    between ranks 0 and 2, one on rank 3 between 1 and 3, and every rank stops; the dense
    weights are still compared over all four. The update before passed the check: experts
    that differ by design (other experts on other ranks of a group) raise nothing."""
    assert len(replicas) == 4
    named = {
        ("experts", 2): f"parameter {EXPERT} differs between expert replica ranks 0 and 2",
        ("experts", 3): f"parameter {EXPERT} differs between expert replica ranks 1 and 3",
        ("dense", 1): "parameter layers.1.attention.wq.weight differs between data-parallel ranks 0 and 1",
    }
    for case, message in named.items():
        reports = [rank[case] for rank in replicas]
        assert all(report is not None and report.startswith("--check-replicas: after update 1, ")
                   for report in reports), (case, reports)
        assert sum(message in report for report in reports) >= 1, (case, reports)
