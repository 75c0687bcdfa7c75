"""``python -m distlm.parity``: layouts known to equal one process are reported equal, a
layout broken on purpose is reported at the step and module where it breaks, a user's
model given as module:function trains, and bad input is one line with exit status 2.

One parity run (four layouts, two updates, a two-block Llama of the user's own) serves
every assertion about results.
"""

from __future__ import annotations

import ast
import json
import os
from pathlib import Path

import pytest
from safetensors.torch import load_file

import distlm
from distlm.backends.hardware import host_cores
from distlm.parity.__main__ import RANKS_PER_CORE, main
from distlm.parity.compare import tolerance_for
from distlm.parity.layouts import parse_layout
from distlm.parity.worker import PERTURB_VARIABLE

TESTS = Path(__file__).parent
# One global batch of 2 x 2 samples for all, so one reference serves every layout.
EQUAL = ["strategy=ddp,dp=2", "strategy=fsdp,dp=2", "tp=2,update_freq=2"]
BROKEN = "tp=2,sequence_parallel=true,update_freq=2"
# Rank 1's shard of the second block's query projection moves by 0.05 before update 2:
# weights of std 0.02, so that block's output moves by a sizeable fraction of itself.
PERTURB = "tp-2_sequence_parallel-true_update_freq-2:2:layers.1.attention.wq.weight:1:0.05"


@pytest.fixture(scope="module")
def parity(tmp_path_factory) -> tuple[int, dict, Path]:
    out = tmp_path_factory.mktemp("parity")
    saved = {key: os.environ.get(key) for key in (PERTURB_VARIABLE, "PYTHONPATH")}
    os.environ[PERTURB_VARIABLE] = PERTURB
    # The workers import the user's model by module name, as a user's PYTHONPATH would find it.
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(TESTS), saved["PYTHONPATH"]]))
    try:
        status = main(["--layouts", *EQUAL, BROKEN, "--steps", "2", "--activations",
                       "--model", "parity_user_model:build", "--device", "cpu",
                       "--batch-size", "2", "--tokens-per-sample", "16", "--out", str(out)])
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
    return status, json.loads((out / "parity.json").read_text()), out


def _layout(report: dict, text: str) -> dict:
    return next(result for result in report["layouts"] if result["layout"] == text)


def test_layouts_known_to_equal_one_process_are_reported_equal(parity):
    status, report, out = parity
    for text in EQUAL:
        result = _layout(report, text)
        assert result["equal"], result["verdict"]
        assert result["verdict"].startswith(f"{text}: equal to one process for 2 updates within")
        assert result["tolerance"] == tolerance_for("fp32", "allreduce").value
        steps = result["steps"]
        assert [row["step"] for row in steps] == [0, 1, 2]
        # Every parameter, and each block's output and input gradient, was compared.
        assert {"layers.0.attention.wq.weight", "tok_embeddings.weight"} <= set(steps[2]["parameters"])
        assert {"output:layers.0", "output:layers.1", "input_grad:layers.0", "input_grad:layers.1"} <= set(
            steps[1]["activations"])
    # The comparison resolves training: two updates (of a warming-up learning rate) moved
    # the reference's weights beyond the tolerance, and 10x beyond any layout's difference.
    assert sorted(path.name for path in out.glob("reference*")) == ["reference"]
    reference = out / "reference"
    before = load_file(str(reference / "params" / "step0.safetensors"))
    after = load_file(str(reference / "params" / "step2.safetensors"))
    moved = max(float((after[name] - before[name]).abs().max() / before[name].abs().max()) for name in before)
    largest = max(diff for text in EQUAL for row in _layout(report, text)["steps"] for diff in row["parameters"].values())
    assert moved > tolerance_for("fp32", "allreduce").value and moved > 10 * largest


def test_a_broken_layout_is_named_at_its_step_and_module(parity):
    status, report, out = parity
    assert status == 1
    broken = _layout(report, BROKEN)
    assert not broken["equal"]
    # Update 1 ran before the perturbation; update 2's forward meets it in the second block.
    assert broken["first_difference"].startswith("step 2: forward output of layers.1 differs by")
    assert "beyond" in broken["verdict"] and "relative" in broken["verdict"]
    step1 = broken["steps"][1]
    assert max(step1["activations"].values()) <= broken["tolerance"]
    assert broken["steps"][2]["activations"]["output:layers.0"] <= broken["tolerance"]
    table = (out / "parity.md").read_text()
    assert all(f"| {text} | 2 |" in table for text in [*EQUAL, BROKEN])


@pytest.mark.parametrize("layout, message", [
    ("strategy=ddp,dp=2,colour=red", "unknown key 'colour'"),
    ("strategy=ring,dp=2", "--strategy ring is not one of"),
    ("dp=two", "dp=two must be a whole number"),
    ("precision=fp8", "precision=fp8 is not one of"),
])
def test_bad_input_is_one_line_and_exit_status_2(layout, message, tmp_path, capsys):
    assert main(["--layouts", layout, "--steps", "1", "--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip()
    assert message in err and "\n" not in err and layout in err


def test_an_out_path_that_is_a_file_is_one_line_and_exit_status_2(tmp_path, capsys):
    target = tmp_path / "parity.txt"
    target.write_text("keep me")
    assert main(["--layouts", "strategy=ddp,dp=2", "--steps", "1", "--out", str(target)]) == 2
    err = capsys.readouterr().err.strip()
    assert f"--out {target} is a file" in err and "\n" not in err
    assert target.read_text() == "keep me"


def test_more_ranks_than_the_machine_can_run_is_one_line_and_exit_status_2(tmp_path, capsys):
    """dp=64 used to start 64 processes on this machine's cores; the limit is named with the flag that raises it."""
    limit = RANKS_PER_CORE * host_cores()
    assert main(["--layouts", "strategy=ddp,dp=2", "dp=64", "--steps", "1", "--out", str(tmp_path / "out")]) == 2
    assert capsys.readouterr().err.splitlines() == [
        f"distlm.parity: error: layout 'dp=64' starts 64 processes, more than the limit of {limit} ({RANKS_PER_CORE} "
        f"per core x {host_cores()} cores); lower its degrees, or raise the limit with --max-ranks 64"]
    assert main(["--layouts", "tp=2", "--max-ranks", "1", "--steps", "1", "--out", str(tmp_path / "out")]) == 2
    assert capsys.readouterr().err.splitlines() == [
        "distlm.parity: error: layout 'tp=2' starts 2 processes, more than the limit of 1; lower its degrees, or "
        "raise the limit with --max-ranks 2"]
    assert not (tmp_path / "out").exists()  # refused before anything started


def test_pipeline_layouts_are_reported_equal_and_refuse_activations(tmp_path, capsys):
    """Each pipeline rank holds its stages' parameters; rank 0 gathers them all. The first
    update's loss counts the pass's own micro-batches only (its shape inference runs the
    loss once more)."""
    layout = parse_layout("pp=2,pp_microbatches=2")
    assert layout.flags[:2] == ["--pp-degree", "2"] and layout.world_size == 2
    assert main(["--layouts", "pp=2", "--steps", "1", "--activations", "--out", str(tmp_path / "refused")]) == 2
    err = capsys.readouterr().err.strip()
    assert "--activations does not record pipeline stages" in err and "\n" not in err
    status = main(["--layouts", "pp=2,pp_microbatches=2", "--steps", "2", "--arch", "llama_tiny", "--device", "cpu",
                   "--batch-size", "2", "--tokens-per-sample", "16", "--out", str(tmp_path / "pp")])
    result = json.loads((tmp_path / "pp" / "parity.json").read_text())["layouts"][0]
    assert status == 0 and result["equal"], result["verdict"]
    # Every parameter of both stages was compared.
    assert {"tok_embeddings.weight", "layers.0.attention.wq.weight", "layers.1.attention.wq.weight",
            "norm.weight", "output.weight"} <= set(result["steps"][2]["parameters"])


def test_the_training_core_never_imports_the_parity_tool():
    package = Path(distlm.__file__).parent
    importers = []
    for path in package.rglob("*.py"):
        if path.is_relative_to(package / "parity"):
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            names = [node.module or ""] if isinstance(node, ast.ImportFrom) else \
                [alias.name for alias in node.names] if isinstance(node, ast.Import) else []
            if any(name == "distlm.parity" or name.startswith("distlm.parity.") for name in names):
                importers.append(str(path.relative_to(package)))
    assert not importers
