"""Expert parallelism combined with tensor and pipeline parallelism trains the same mixture of experts as one process.

Each 4-rank layout runs UPDATES updates of the same global batch as a single-process
reference computed here, and the consolidated parameters, gradient norms and train-line
routing statistics (aux loss, load imbalance, dropped tokens) are compared:

- EP 2 x TP 2: tensor parallel 2 inside each of 2 data-parallel replicas, the expert-parallel
  groups carved from the data-parallel ranks of each tensor-parallel place
  (distlm/parallel/expert.py); and TP 2 x DP 2 without expert parallel;
- EP 2 x PP 2: 2 pipeline stages, expert parallel over each stage's 2 data-parallel ranks
  (DDP, and FSDP for the dense parameters). A pipeline routes each of its micro-batches apart,
  so its reference is one process training on the same micro-batches (``train_in_micro_batches``).

Both router setups of tests/test_expert_parallel.py run under EP 2 x TP 2 and EP 2 x PP 2
(softmax with the aux loss; sigmoid with its bias update, a shared expert and the aux loss),
the softmax one under the other two layouts. All share one 4-rank job.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from distributed import Scenarios
from distlm.config import parse_args
from distlm.data.batches import with_host_facts
from distlm.models import build_model
from distlm.models.contract import model_tp_plan
from distlm.state.full import consolidated_parameters
from distlm.parallel.tp import _resolve
from distlm.training.trainer import Trainer
from test_ddp import assert_params_close
from test_expert_parallel import UPDATES, args_for, train

# Tolerance: the same fp32 reassociation as tests/test_expert_parallel.py's PARAM_ATOL argues,
# plus tensor parallel's (the attention output projection sums two half-head partial products
# across ranks, the query/key norms' gradients are summed over the ranks' heads) and the
# pipeline's (gradients accumulated over its micro-batches); Adam bounds the effect by
# lr * dg / eps as before. Measured after 3 updates: up to 6e-7 under TP, 2e-7 under PP. A wrong
# reduction or weight moves some parameter by ~lr (1e-3) per update: the norms' gradients left
# unsummed over TP, the aux loss weighted per --update-freq batch instead of per pipeline
# micro-batch, or the shape-inference forward of the pipeline's first step counted in the routing
# statistics each ended 1e-3 to 4e-3 off.
PARAM_ATOL = 5e-6
pytestmark = pytest.mark.timeout(900)

LAYOUTS = {"ep2-tp2": ["--ep-degree", "2", "--tp-degree", "2"],
           "tp2": ["--tp-degree", "2"],
           "ep2-pp2": ["--ep-degree", "2", "--pp-degree", "2", "--pp-microbatches", "2"],
           "ep2-pp2-fsdp": ["--ep-degree", "2", "--pp-degree", "2", "--pp-microbatches", "2", "--strategy", "fsdp"]}
CASES = [("ep2-tp2", "softmax"), ("ep2-tp2", "sigmoid"), ("tp2", "softmax"), ("ep2-pp2", "softmax"),
         ("ep2-pp2", "sigmoid"), ("ep2-pp2-fsdp", "softmax")]
# The pipeline's micro-batches as rows of the global batch: each of its 2 data-parallel ranks
# holds 4 consecutive rows (distlm/data/sampler.py) and splits them into 2 micro-batches of 2.
PIPELINE_MICRO_BATCHES = [[0, 1, 4, 5], [2, 3, 6, 7]]


def train_in_micro_batches(args: list[str], groups: list[list[int]]) -> dict:
    """One process training on the global batch split into micro-batches of the rows ``groups``
    (as --update-freq splits it), with ``train``'s results."""
    trainer = Trainer(parse_args(args))
    batches = trainer.update_batches()
    records = []
    for _ in range(UPDATES):
        (batch,) = next(batches)
        micro_batches = [with_host_facts({key: batch[key][rows] for key in ("input_ids", "targets")},
                                         trainer.model.padding_idx, "masked_positions" in batch)
                         for rows in map(torch.tensor, groups)]
        record = trainer.train_step(micro_batches)
        records.append({key: record[key] for key in ("gnorm", "aux_loss", "load_imbalance", "dropped_tokens")})
    return {"records": records, "params": consolidated_parameters(trainer.model)}


@pytest.fixture(scope="module")
def references(data_dir, tmp_path_factory) -> dict:
    """One process, the global batch, per router setup."""
    root = tmp_path_factory.mktemp("reference")
    plain = {router: train(args_for(data_dir, root / router, router, 1)) for router in ("softmax", "sigmoid")}
    # A pipeline routes, and takes the aux loss of, each of its micro-batches apart, as one
    # process does each of its --update-freq micro-batches: the same micro-batches here.
    pipelined = {router: train_in_micro_batches(args_for(data_dir, root / f"{router}-mb", router, 1),
                                                PIPELINE_MICRO_BATCHES) for router in ("softmax", "sigmoid")}
    return {"ep2-tp2": plain, "tp2": plain, "ep2-pp2": pipelined, "ep2-pp2-fsdp": pipelined}


@pytest.fixture(scope="module")
def four(data_dir, tmp_path_factory) -> dict:
    """One 4-rank job running every case."""
    root = tmp_path_factory.mktemp("expert_combinations")
    # The per-rank batch is the global batch over the data-parallel ranks (2 here, not 4).
    return Scenarios(4, [
        (f"{layout}-{router}", train, (args_for(data_dir, root / f"{layout}-{router}", router, 2, *LAYOUTS[layout]),))
        for layout, router in CASES
    ], timeout=900)


@pytest.mark.parametrize("layout, router", CASES)
def test_expert_parallel_combinations_train_like_one_process(layout, router, four, references):
    ranks = four[f"{layout}-{router}"]
    reference = references[layout][router]
    # A pipeline stage's ranks hold its own layers' parameters; together the stages hold all.
    assert set().union(*(result["params"] for result in ranks)) == reference["params"].keys()
    for rank, result in enumerate(ranks):
        assert_params_close(result["params"], {name: reference["params"][name] for name in result["params"]},
                            PARAM_ATOL)
        # The train line's numbers are every rank's: global statistics, as one process counts them.
        # Loads are integer counts (exact); the aux loss sums router probabilities in another order.
        for mine, theirs in zip(result["records"], reference["records"]):
            np.testing.assert_allclose(mine["gnorm"], theirs["gnorm"], rtol=1e-5, err_msg=f"rank {rank}")
            np.testing.assert_allclose(mine["aux_loss"], theirs["aux_loss"], rtol=1e-5, err_msg=f"rank {rank}")
            assert mine["load_imbalance"] == theirs["load_imbalance"], rank
            assert mine["dropped_tokens"] == theirs["dropped_tokens"] == 0


def test_the_tensor_parallel_plan_splits_attention_and_dense_layers_and_keeps_experts_whole():
    """Every MoE layer (router, experts) stays out of the plan; a dense feed-forward between
    them splits as Llama's, and the query/key norms take their per-head style."""
    with torch.device("meta"):
        model = build_model("qwen3_moe_tiny", vocab_size=50, n_layers=2, moe_every=2)
    styles = _resolve(model, model_tp_plan(model))
    assert styles["layers.0.feed_forward.w1"] == "colwise" and styles["layers.1.attention.wq"] == "colwise"
    assert styles["layers.0.attention.q_norm"] == styles["layers.1.attention.k_norm"] == "head_norm"
    assert not any(name.startswith("layers.1.feed_forward.") for name in styles)
