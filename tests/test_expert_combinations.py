"""Expert parallelism combined with tensor parallelism trains the same mixture of experts as one process.

EP 2 x TP 2 on 4 ranks (tensor parallel 2 inside each of 2 data-parallel replicas, the
expert-parallel groups carved from the data-parallel ranks of each tensor-parallel place:
distlm/parallel/expert.py) runs UPDATES updates of the same global batch as a
single-process reference computed here, for both router setups of
tests/test_expert_parallel.py (softmax router with the aux loss; sigmoid router with its
bias update, a shared expert and the aux loss), and the consolidated parameters, gradient
norms and train-line routing statistics are compared. Both setups share one 4-rank job.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from distributed import Scenarios
from test_ddp import assert_params_close
from test_expert_parallel import UPDATES, args_for, train

# Tolerance: the same fp32 reassociation as tests/test_expert_parallel.py's PARAM_ATOL argues
# (measured there 2e-7 to 8e-7), plus tensor parallel's: the attention output projection sums
# two half-head partial products across ranks, and the query/key norms' gradients are summed
# over the ranks' heads. Adam bounds the effect by lr * dg / eps as before. A wrong reduction
# (say, expert gradients or the norms' gradients not summed) moves some parameter by ~lr (1e-3).
PARAM_ATOL = 5e-6
pytestmark = pytest.mark.timeout(900)

LAYOUTS = {"ep2-tp2": ["--ep-degree", "2", "--tp-degree", "2"]}


@pytest.fixture(scope="module")
def references(data_dir, tmp_path_factory) -> dict:
    """One process, the global batch, per router setup."""
    root = tmp_path_factory.mktemp("reference")
    return {router: train(args_for(data_dir, root / router, router, 1)) for router in ("softmax", "sigmoid")}


@pytest.fixture(scope="module")
def four(data_dir, tmp_path_factory) -> dict:
    """One 4-rank job running every layout with both router setups."""
    root = tmp_path_factory.mktemp("expert_combinations")
    # The per-rank batch is the global batch over the data-parallel ranks (2 here, not 4).
    return Scenarios(4, [
        (f"{layout}-{router}", train, (args_for(data_dir, root / f"{layout}-{router}", router, 2, *flags),))
        for layout, flags in LAYOUTS.items() for router in ("softmax", "sigmoid")
    ], timeout=900)


@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("router", ["softmax", "sigmoid"])
def test_expert_parallel_combinations_train_like_one_process(layout, router, four, references):
    ranks = four[f"{layout}-{router}"]
    reference = references[router]
    for rank, result in enumerate(ranks):
        assert_params_close(result["params"], reference["params"], PARAM_ATOL)
        # The train line's numbers are every rank's: global statistics, as one process counts them.
        # Loads are integer counts (exact); the aux loss sums router probabilities in another order.
        for mine, theirs in zip(result["records"], reference["records"]):
            np.testing.assert_allclose(mine["gnorm"], theirs["gnorm"], rtol=1e-5, err_msg=f"rank {rank}")
            np.testing.assert_allclose(mine["aux_loss"], theirs["aux_loss"], rtol=1e-5, err_msg=f"rank {rank}")
            assert mine["load_imbalance"] == theirs["load_imbalance"], rank
            assert mine["dropped_tokens"] == theirs["dropped_tokens"] == 0
