"""--compile: each block compiled with inductor trains the same model as eager, under DDP,
FSDP and tensor parallel, and a second run takes its graphs from --compile-cache."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from torch._dynamo.utils import counters

from distributed import run_distributed
from distlm.training.precompile import CompileReport
from test_ddp import assert_params_close, common_args, train

# Inductor fuses each block's elementwise work into C++ loops and may reassociate sums,
# the same kind of fp32 rounding difference as two ranks against one (test_ddp.py's
# PARAM_ATOL, measured there at ~2e-7); a missed or doubled update moves parameters by
# ~lr = 1e-3, so the bound of 5e-6 keeps a wide margin on both sides.
PARAM_ATOL = 5e-6


@pytest.fixture(scope="module")
def compile_cache(tmp_path_factory) -> str:
    """One cache for the module: DDP and FSDP run the same block graph, so it compiles once."""
    return str(tmp_path_factory.mktemp("compile_cache"))


def eager_and_compiled(layouts: list[list[str]], cache: str) -> list[tuple[dict, dict, int]]:
    """(eager, compiled, graphs dynamo captured for the compiled run) per layout."""
    runs = []
    for args in layouts:
        eager = train(args)
        before = counters["stats"]["unique_graphs"]
        compiled = train(args + ["--compile", "--compile-cache", cache])
        runs.append((eager, compiled, counters["stats"]["unique_graphs"] - before))
    return runs


def test_compiled_blocks_train_like_eager_under_every_layout(data_dir, tmp_path, compile_cache):
    args = common_args(data_dir, str(tmp_path), "llama_tiny") + ["--batch-size", "4"]
    # DDP through a Python communication hook (two simulated nodes of one rank), FSDP,
    # and tensor parallel with activation checkpointing around the compiled blocks.
    layouts = [args + ["--comm-hook", "hierarchical", "--ranks-per-node", "1"], args + ["--strategy", "fsdp"],
               args + ["--tp-degree", "2", "--activation-checkpointing"]]
    ranks = run_distributed(eager_and_compiled, 2, layouts, compile_cache, timeout=600)
    for rank in ranks:
        for (eager, compiled, graphs), layout in zip(rank, ["ddp + hook", "fsdp", "ddp x tp2 + checkpointing"]):
            assert graphs > 0, f"{layout}: nothing was compiled"
            assert compiled["initial"].keys() == eager["initial"].keys(), layout  # names unchanged by compile
            assert_params_close(compiled["params"], eager["params"], PARAM_ATOL)
            np.testing.assert_allclose(compiled["gnorms"], eager["gnorms"], rtol=1e-5, err_msg=layout)


def test_precompile_fills_the_cache_the_next_run_takes_its_graphs_from(data_dir, tmp_path, compile_cache):
    """--precompile (Neuron's parallel-compile step) compiles, saves nothing and exits; the
    training run after it compiles nothing."""
    save_dir = tmp_path / "save"
    args = [a for a in common_args(data_dir, str(save_dir), "llama_tiny") if a != "--no-save"]
    command = [sys.executable, "-m", "distlm.train", *args, "--batch-size", "4", "--max-update", "1",
               "--disable-validation", "--compile", "--compile-cache", compile_cache]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    lines = []
    for extra in (["--precompile"], []):
        done = subprocess.run(command + extra, capture_output=True, text=True, env=env, timeout=600)
        assert done.returncode == 0, done.stderr
        lines.append(next(line for line in done.stderr.splitlines() if "first update with compilation" in line))
        if extra:
            assert not any(save_dir.glob("checkpoint*")), "--precompile saves nothing"
    assert re.search(r": 0 graphs compiled, [1-9]\d* taken from the compile cache", lines[1]), lines
    assert any((Path(compile_cache) / "inductor").rglob("*.py")), "the artefacts are in --compile-cache"


def test_backends_with_caches_of_their_own_report_the_graphs_captured():
    report = CompileReport("eager")
    compiled = torch.compile(lambda x: torch.sin(x) + 1, backend="eager")
    compiled(torch.ones(3))
    assert re.search(r": 1 graphs captured for the eager backend, whose own cache", report.log())
