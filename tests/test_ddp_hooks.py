"""Communication hooks end to end: 5 updates through the Trainer against one process.

Every run uses --check-replicas, so the parameters are also verified bit-identical on
every rank after every update (the check raises otherwise).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from distributed import run_distributed
from test_ddp import PARAM_ATOL, assert_params_close, common_args, train

GLOBAL_BATCH = 8

# Half-precision bound. Elementwise bounds do not work here: a gradient element whose
# per-rank parts nearly cancel carries a half-precision rounding of the *parts*, which
# Adam's division by sqrt(v) can turn into most of a step (lr) for that element. So the
# test bounds the whole update instead: ||theta_hook - theta_ref|| / ||theta_ref - theta_0||.
# The hook rounds each divided gradient once to half and sums n <= 4 terms in half, a
# relative error of a few units of half precision u (2**-11 fp16, 2**-8 bf16) in the
# gradient, which Adam passes on to the update at about the same size in aggregate;
# 10 u allows for that. Measured: 6.7e-4 (fp16), 2.4e-3 (bf16). One update more or less
# gives 0.19, so the bound keeps a margin of 5x or more on both sides.
HALF_UPDATE_RTOL = {"fp16": 10 * 2**-11, "bf16": 10 * 2**-8}
HALF_GNORM_RTOL = {"fp16": 2e-3, "bf16": 1.5e-2}


def relative_update_difference(actual: dict, reference: dict, initial: dict) -> float:
    difference = sum(float(((actual[k] - reference[k]) ** 2).sum()) for k in reference) ** 0.5
    update = sum(float(((reference[k] - initial[k]) ** 2).sum()) for k in reference) ** 0.5
    return difference / update


@pytest.mark.parametrize(
    "hook, world_size",
    [("fp16", 2), ("bf16", 2), ("hierarchical", 4), ("hierarchical-fp16", 4)],
)
def test_hook_trains_like_one_process(data_dir, tmp_path, hook, world_size):
    args = common_args(data_dir, str(tmp_path))
    reference = train(args + ["--batch-size", str(GLOBAL_BATCH)])
    hooked = args + [
        "--batch-size", str(GLOBAL_BATCH // world_size), "--comm-hook", hook, "--check-replicas",
        # 4 processes on one machine as 2 simulated nodes of 2 ranks.
        "--ranks-per-node", "2",
    ]
    ranks = run_distributed(train, world_size, hooked, timeout=240)
    half = "bf16" if "bf16" in hook else "fp16" if "fp16" in hook else None
    for result in ranks:
        if half:
            drift = relative_update_difference(result["params"], reference["params"], reference["initial"])
            assert drift < HALF_UPDATE_RTOL[half], drift
            np.testing.assert_allclose(result["gnorms"], reference["gnorms"], rtol=HALF_GNORM_RTOL[half])
        else:
            assert_params_close(result["params"], reference["params"], PARAM_ATOL)
            np.testing.assert_allclose(result["gnorms"], reference["gnorms"], rtol=1e-5)


def train_double_buffered(args: list[str]) -> dict:
    """Five steps with --double-buffering: the first applies nothing, the rest one-step-stale gradients."""
    from distlm.config import parse_args
    from distlm.parallel.names import unwrap
    from distlm.trainer import Trainer

    trainer = Trainer(parse_args(args))
    batches = trainer.update_batches()
    initial = {n: p.detach().clone() for n, p in unwrap(trainer.model).named_parameters()}
    gnorms = [trainer.train_step(next(batches))["gnorm"]]
    after_first = {n: p.detach().clone() for n, p in unwrap(trainer.model).named_parameters()}
    updates_after_first = trainer.num_updates
    for _ in range(4):
        gnorms.append(trainer.train_step(next(batches))["gnorm"])
    final = {n: p.detach().clone() for n, p in unwrap(trainer.model).named_parameters()}
    return {"initial": initial, "after_first": after_first, "final": final,
            "updates_after_first": updates_after_first, "updates": trainer.num_updates, "gnorms": gnorms,
            "consumed": trainer.consumed_samples}


@pytest.mark.parametrize(
    "extra",
    [["--comm-hook", "allreduce"], ["--comm-hook", "fp16"],
     # fp16 training: stale gradients must be unscaled with the loss scale they were made with.
     ["--fp16", "--allow-slow-fp16", "--fp16-scale-window", "2"]],
    ids=["allreduce", "fp16-hook", "fp16-loss-scaling"],
)
def test_double_buffering_skips_the_first_update_and_keeps_replicas_identical(data_dir, tmp_path, extra):
    args = common_args(data_dir, str(tmp_path)) + ["--batch-size", "4", "--double-buffering", "--check-replicas"]
    ranks = run_distributed(train_double_buffered, 2, args + extra)
    if "--fp16" in extra:
        # The loss scale doubles every 2 updates; unscaling a stale gradient with the
        # current scale would halve its norm there. fp16 autocast itself moves the
        # norms by ~1e-3 relative, so 5e-2 separates the two cases.
        fp32 = run_distributed(train_double_buffered, 2, args)
        np.testing.assert_allclose(ranks[0]["gnorms"][1:], fp32[0]["gnorms"][1:], rtol=5e-2)
    for result in ranks:
        # The first update's gradients are still in flight: no parameter moves, no update counted.
        assert result["updates_after_first"] == 0
        for name, value in result["initial"].items():
            assert torch.equal(value, result["after_first"][name]), name
        assert result["updates"] == 4 and result["consumed"] == 5 * 8
        assert any(not torch.equal(v, result["final"][n]) for n, v in result["initial"].items())
