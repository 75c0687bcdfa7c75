"""Pipeline parallelism through the Trainer: the same model as one process under every
schedule and beside data and tensor parallel, tied embeddings, validation, the fp16
finite check, checkpoints that move between layouts, and the layouts refused.

Pipeline jobs are expensive, so each spawned job runs several checks on tiny shapes
(4 blocks, 16 tokens, batches of 4, 3 updates; beside data parallel, batches of 8 and 2 updates).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch.distributed.tensor import DTensor

from safetensors import safe_open

from distributed import Scenarios, run_distributed
from distlm import checkpoint
from distlm.export import cli as export
from distlm.checkpoint.stateful import optimizer_state
from distlm.config import parse_args
from distlm.training.divergence import DivergenceError
from distlm.state.full import consolidated_parameters
from distlm.train import main
from distlm.training.trainer import Trainer
from test_ddp import common_args

UPDATES = 3
SHAPE = ["--tokens-per-sample", "16", "--batch-size", "4"]
LOOPED = ["--pp-stages-per-rank", "2"]
SCHEDULES = {
    "gpipe": ["--pp-schedule", "gpipe", "--pp-split", "0:1,1:4"],  # and an uneven split
    "1f1b": ["--pp-schedule", "1f1b"],
    "interleaved-1f1b": ["--pp-schedule", "interleaved-1f1b", *LOOPED],
    "zero-bubble": ["--pp-schedule", "zero-bubble", *LOOPED],
    "zbv": ["--pp-schedule", "zbv", *LOOPED],
}
# Tolerance: a pipeline computes each block on quarter batches (micro-batches) and sums
# their gradients, where one process multiplies the whole batch at once: fp32
# reassociation, ~1e-7 relative in the gradients. Adam (eps 1e-6) turns that into
# parameter differences of at most ~2e-7 in 3 updates at lr 1e-3 (measured 1.9e-7);
# a wrong micro-batch, a missing tied gradient or one update too many moves parameters
# by ~1e-4 or more. Beside data parallel the two replicas' gradients are averaged too, and
# Adam amplifies that rounding where its second moment is tiny (measured up to 8.2e-7).
PARAM_ATOL = 2e-6
MICROBATCHES = (2, 4, 8)
"""Micro-batches per pass beside data parallel: as many as the 2 stages, twice, four times."""
DP_STRATEGIES = {"ddp": ["--update-freq", "2"], "zero1": ["--strategy", "zero1"], "fsdp": ["--strategy", "fsdp"]}
DP_UPDATES = 2


def args_for(data_dir: str, save_dir: str, arch: str, *extra: str) -> list[str]:
    """The run's flags; it saves and resumes only where ``save_dir`` is not the shared "none"."""
    args = common_args(data_dir, save_dir, arch) + SHAPE + list(extra)
    return args if save_dir.endswith("none") else [a for a in args if a != "--no-save"]


def full(tensor: torch.Tensor) -> torch.Tensor:
    return (tensor.full_tensor() if isinstance(tensor, DTensor) else tensor).detach().clone()


def moments(trainer: Trainer) -> dict[str, torch.Tensor]:
    """Adam's moments of the parameters this rank holds, whole (collective over their shards)."""
    return {f"{name}.{key}": full(value) for name, entry in optimizer_state(trainer.model, trainer.optimizer).items()
            for key, value in entry.items() if key in ("exp_avg", "exp_avg_sq")}


def train(args: list[str], updates: int = UPDATES, save: bool = False, valid: bool = False) -> dict:
    """Parameters (and Adam's moments) of this rank's stage after ``updates`` updates, and
    with ``valid`` the validation loss then."""
    trainer = Trainer(parse_args(args))
    batches = trainer.update_batches()
    records = [trainer.train_step(next(batches)) for _ in range(updates)]
    gnorms = [record["gnorm"] for record in records]
    losses = [float(record["loss_sum"]) for record in records]
    if save:
        trainer.save_checkpoint()
    return {"params": consolidated_parameters(trainer.model), "moments": moments(trainer), "gnorms": gnorms,
            "losses": losses,
            "valid": trainer.validator.validate(trainer.model)[0].loss if valid else None}


def resumed(args: list[str]) -> dict:
    """Parameters and moments right after resuming from ``--save-dir``'s checkpoint_last."""
    trainer = Trainer(parse_args(args))
    assert trainer.resumed_at == UPDATES
    return {"params": consolidated_parameters(trainer.model), "moments": moments(trainer)}


def merged(ranks: list[dict], key: str) -> dict[str, torch.Tensor]:
    """One dict of every stage's tensors; a name held by two ranks (a replica, a tied copy)
    must be bit-identical on both."""
    out: dict[str, torch.Tensor] = {}
    for rank in ranks:
        for name, value in rank[key].items():
            if name in out:
                assert torch.equal(out[name], value), f"{name} differs between the ranks holding it"
            out[name] = value
    return out


def assert_close(actual: dict, expected: dict, atol: float = PARAM_ATOL) -> None:
    assert actual.keys() == expected.keys()
    for name in expected:
        torch.testing.assert_close(actual[name], expected[name], rtol=0, atol=atol, msg=lambda m: f"{name}: {m}")


def two_rank_checks(data_dir: str, root: str, reshard_from: str) -> dict:
    """Everything the 2-rank job checks (one process group, several trainers)."""
    out: dict = {}
    for arch in ("llama_tiny", "roberta_tiny"):
        for name, flags in SCHEDULES.items():
            if arch == "roberta_tiny" and name in ("gpipe", "zero-bubble"):
                continue  # the tied embedding: across ranks (1f1b, interleaved) and on one rank (zbv)
            out[arch, name] = train(args_for(data_dir, f"{root}/none", arch, "--pp-degree", "2", *flags), valid=True)
    # Validation through the forward-only schedule, 20 samples in batches of 3: the last
    # batch is short and padded with rows that predict nothing.
    trainer = Trainer(parse_args(args_for(data_dir, f"{root}/none", "llama_tiny", "--pp-degree", "2",
                                          "--batch-size-valid", "3", "--clip-norm", "0")))
    out["valid"] = trainer.validator.validate(trainer.model)[0].loss
    # Without a loss scaler a non-finite gradient stops the run, naming the parameter on its
    # stage (no clipping: a NaN norm would make every gradient NaN first).
    if trainer.pipeline.holds_last:
        trainer.model.norm.weight.register_hook(lambda grad: grad * float("inf"))
    with pytest.raises(DivergenceError) as diverged:
        trainer.train_step(next(trainer.update_batches()))
    out["diverged"] = str(diverged.value)
    # The save at fsdp 2 that the pipeline resumes, and the pipeline resuming one of pp 2 x tp 2.
    fsdp_dir = f"{root}/fsdp"
    out["fsdp_saved"] = train(args_for(data_dir, fsdp_dir, "llama_tiny", "--strategy", "fsdp"), save=True)
    out["pp_from_fsdp"] = resumed(args_for(data_dir, fsdp_dir, "llama_tiny", "--pp-degree", "2"))
    out["fsdp_from_pp_tp"] = resumed(args_for(data_dir, reshard_from, "llama_tiny", "--strategy", "fsdp"))
    out["overflow"] = overflow_on_last_stage(data_dir, f"{root}/none")
    return out


def overflow_on_last_stage(data_dir: str, save_dir: str) -> dict:
    """fp16 with an infinite gradient made on the last stage only: every stage must skip."""
    trainer = Trainer(parse_args(args_for(data_dir, save_dir, "llama_tiny", "--pp-degree", "2", "--fp16",
                                          "--allow-slow-fp16")))
    before = {name: p.detach().clone() for name, p in trainer.model.named_parameters()}
    if trainer.pipeline.holds_last:
        trainer.model.norm.weight.register_hook(lambda grad: grad * float("inf"))
    scale = trainer.precision.loss_scale
    record = trainer.train_step(next(trainer.update_batches()))
    unchanged = all(torch.equal(p, before[name]) for name, p in trainer.model.named_parameters())
    return {"applied": record["applied"], "unchanged": unchanged, "updates": trainer.num_updates,
            "scale": (scale, trainer.precision.loss_scale)}


@pytest.fixture(scope="module")
def four_ranks(data_dir, tmp_path_factory) -> dict:
    """The module's one 4-rank job: pp 2 x dp 2 under each strategy with each micro-batch
    count (batches of 8 per replica, 2 updates), and pp 2 x tp 2 with sequence parallel,
    which saves the checkpoint the 2-rank job reshards: {"pp_tp": that save dir, "job": Scenarios}."""
    root = tmp_path_factory.mktemp("pipeline4")
    scenarios = [(f"{strategy}-{count}", train, (args_for(
        data_dir, str(root / "none"), "llama_tiny", "--pp-degree", "2", "--batch-size", "8",
        "--pp-microbatches", str(count), *flags), DP_UPDATES))
        for strategy, flags in DP_STRATEGIES.items() for count in MICROBATCHES]
    pp_tp_dir = str(root / "pp_tp")
    scenarios.append(("pp_tp", train, (args_for(data_dir, pp_tp_dir, "llama_tiny", "--pp-degree", "2",
                                                "--tp-degree", "2", "--sequence-parallel"), UPDATES, True)))
    return {"pp_tp": pp_tp_dir, "job": Scenarios(4, scenarios, timeout=300)}


@pytest.fixture(scope="module")
def dp_references(data_dir, tmp_path_factory) -> dict[int, dict]:
    """One process on the global batch of pp 2 x dp 2, by its rows: batches of 8 on each of 2
    replicas, in one pipeline pass per update (two for ddp's --update-freq 2): 16 (32)."""
    root = tmp_path_factory.mktemp("pipeline_reference")
    return {rows: train(args_for(data_dir, str(root / "none"), "llama_tiny", "--batch-size", str(rows)), DP_UPDATES)
            for rows in (16, 32)}


@pytest.mark.parametrize("count", MICROBATCHES)
@pytest.mark.parametrize("strategy", DP_STRATEGIES)
def test_pipeline_beside_data_parallel(strategy, count, four_ranks, dp_references):
    """pp 2 x dp 2 equals one process with as many micro-batches as stages (where no forward
    runs between a stage's first and last backward), twice and four times as many; ddp also
    with two pipeline passes per update."""
    ranks = four_ranks["job"][f"{strategy}-{count}"]
    assert_close(merged(ranks, "params"), dp_references[32 if strategy == "ddp" else 16]["params"])


def test_pipeline_two_ranks(data_dir, tmp_path, four_ranks):
    """pp 2 under every schedule, and pp 2 x tp 2 with sequence parallel on 4 ranks, equal one
    process; tied copies stay bit-identical; the validation loss equals one process's;
    checkpoints move between pp 2 and fsdp 2; an overflow on the last stage skips the update
    everywhere (and, without a loss scaler, stops the run naming the parameter on its stage);
    export reads a pp x tp checkpoint."""
    pp_tp_dir = four_ranks["pp_tp"]
    pp_tp = four_ranks["job"]["pp_tp"]
    saved = {key: merged(pp_tp, key) for key in ("params", "moments")}
    ranks = run_distributed(two_rank_checks, 2, data_dir, str(tmp_path), pp_tp_dir, timeout=300)
    for arch in ("llama_tiny", "roberta_tiny"):
        reference = train(args_for(data_dir, str(tmp_path / "none"), arch), valid=True)
        if arch == "llama_tiny":
            assert_close(saved["params"], reference["params"])
        for key in ranks[0]:
            if isinstance(key, tuple) and key[0] == arch:
                assert_close(merged([r[key] for r in ranks], "params"), reference["params"])
                assert ranks[0][key]["gnorms"] == pytest.approx(reference["gnorms"], rel=1e-5)
                # The summed loss of each update, on every stage: the first update's pass also
                # infers shapes, whose extra run of the loss must not count.
                for rank in ranks:
                    assert rank[key]["losses"] == pytest.approx(reference["losses"], rel=1e-6)
                # Each schedule's forward-only pass over the validation split, on parameters
                # ~1e-7 from the reference's.
                assert ranks[0][key]["valid"] == ranks[1][key]["valid"] == pytest.approx(reference["valid"], rel=1e-5)
    # The tied embedding exists on both ranks under 1f1b and interleaved (merged() checked
    # the copies bit for bit), on one rank under zbv (its stages share it).
    assert "embed_tokens.weight" in ranks[0]["roberta_tiny", "1f1b"]["params"]
    assert "embed_tokens.weight" in ranks[1]["roberta_tiny", "1f1b"]["params"]
    assert "embed_tokens.weight" not in ranks[1]["roberta_tiny", "zbv"]["params"]

    single = Trainer(parse_args(args_for(data_dir, str(tmp_path / "none"), "llama_tiny", "--batch-size-valid", "3")))
    valid = single.validator.validate(single.model)[0].loss
    # The same token losses summed in another order (micro-batches, then the pipeline's sum).
    assert ranks[0]["valid"] == ranks[1]["valid"] == pytest.approx(valid, rel=1e-6)

    fsdp_saved = {key: merged([r["fsdp_saved"] for r in ranks], key) for key in ("params", "moments")}
    for key in ("params", "moments"):
        # Resuming copies the saved values: equal exactly, whatever the layout.
        assert_close(merged([r["pp_from_fsdp"] for r in ranks], key), fsdp_saved[key], atol=0)
        assert_close(merged([r["fsdp_from_pp_tp"] for r in ranks], key), saved[key], atol=0)
    one = resumed(args_for(data_dir, pp_tp_dir, "llama_tiny"))
    for key in ("params", "moments"):
        assert_close(one[key], saved[key], atol=0)
    export.export(str(Path(pp_tp_dir) / checkpoint.LAST), str(tmp_path / "exported.safetensors"))
    with safe_open(str(tmp_path / "exported.safetensors"), "pt") as exported:
        assert_close({name: exported.get_tensor(name) for name in exported.keys()}, saved["params"], atol=0)

    for rank in ranks:
        assert "first non-finite in the gradient of norm.weight;" in rank["diverged"], rank["diverged"]
        overflow = rank["overflow"]
        assert not overflow["applied"] and overflow["unchanged"] and overflow["updates"] == 0
        assert overflow["scale"][1] == overflow["scale"][0] / 2


@pytest.mark.parametrize("flags, words", [
    (["--pp-degree", "2"], "world size"),
    (["--pp-degree", "8", "--distributed-world-size", "8"], "4 blocks"),
    (["--pp-degree", "2", "--decoder-layers", "1", "--distributed-world-size", "2"],
     "has 1 block; use at most 1 stage"),
    (["--pp-degree", "2", "--pp-schedule", "interleaved-1f1b", "--distributed-world-size", "2"],
     "--pp-stages-per-rank 2"),
    (["--pp-degree", "2", "--pp-microbatches", "3", "--distributed-world-size", "2"], "does not split"),
    (["--pp-degree", "2", "--pp-split", "0:1,2:4", "--distributed-world-size", "2"], "follow each other"),
])
def test_bad_pipeline_layouts_are_one_line(data_dir, tmp_path, capsys, flags, words):
    """Refused before any rendezvous (the init method names a host that does not exist)."""
    explicit = ["--distributed-rank", "0", "--distributed-init-method", "tcp://192.0.2.1:1"] if (
        "--distributed-world-size" in flags) else []
    assert main(args_for(data_dir, str(tmp_path), "llama_tiny", *flags, *explicit)) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and words in err[0], err


def test_model_without_blocks_is_refused(tmp_path):
    from distlm.config import TrainConfig
    from distlm.errors import UsageError
    from distlm.mesh import ParallelDims
    from distlm.parallel.pipeline import check_pipeline

    config = TrainConfig()
    with pytest.raises(UsageError, match="declares none"):
        check_pipeline(torch.nn.Linear(2, 2), config, ParallelDims(world_size=2, pp=2), "Linear")


@pytest.mark.parametrize("stages", [2, 3, 4])
def test_balanced_split_minimises_the_largest_stage(stages):
    """Against every contiguous split of llama_tiny's 4 blocks (embedding on the first
    stage, norm and head on the last), on the meta device."""
    from itertools import combinations

    from distlm.training.builder import resolve_model_spec
    from distlm.config import ModelConfig
    from distlm.parallel.pipeline import _part_size, balanced_split

    model = resolve_model_spec(ModelConfig(arch="llama_tiny")).build(3000, 1)
    sizes = [sum(p.numel() for p in block.parameters()) for block in model.blocks]
    ends = (_part_size(model, model.embed_modules), _part_size(model, model.head_modules))

    def largest(ranges):
        return max(sum(sizes[i] for i in r) + (ends[0] if k == 0 else 0) + (ends[1] if k == len(ranges) - 1 else 0)
                   for k, r in enumerate(ranges))

    splits = [[range(a, b) for a, b in zip((0, *cuts), (*cuts, 4))] for cuts in combinations(range(1, 4), stages - 1)]
    found = balanced_split(model, stages)
    assert found in splits and largest(found) == min(largest(split) for split in splits)
