"""Tensor parallel (+ sequence parallel, loss parallel) trains the same model as one process.

The single-process reference is computed here, in the test process; the parallel runs
are real gloo processes (2 ranks) that train the same model from the same seed on the
same global batch and compare their gathered parameters with it. Tensor parallel combined
with data parallelism runs through the Trainer in tests/test_strategies.py.
Several configurations share one spawned job, because starting processes dominates the
time on this 2-core machine.
"""

from __future__ import annotations

import contextlib
import re

import pytest
import torch
import torch.nn.functional as F
from torch.distributed.tensor import Replicate, Shard

from distributed import run_distributed
from distlm.errors import UsageError
from distlm.models import arch_names, build_model
from distlm.models.contract import model_tp_plan
from distlm.parallel.tp import STYLES, validate_tp

ARCH_NAMES = ("roberta_tiny", "llama_tiny")
# The byte vocabulary with <mask>: odd, so Llama's vocabulary-parallel embedding, output
# and loss run on uneven shards (131 + 130 rows), the case distlm meets by default.
VOCAB = 261
STEPS = 5
LR = 1e-3
# fairseq's RoBERTa recipe uses --adam-eps 1e-6. Adam's step is lr * m / (sqrt(v) + eps):
# for the few elements whose gradient is ~1e-9 (fp32 rounding noise where terms of ~1e-2
# cancel), eps=1e-8 lets that noise pick the step's sign and moves them by up to lr
# (measured 1e-4 after 5 steps, 1-5 elements of 1e5 per tensor). eps=1e-6 bounds the
# amplification to lr * |dg| / eps, which keeps the comparison meaningful.
EPS = 1e-6
CLIP = 1.0  # below every gradient norm here (2-8), so clipping acts on every step
BATCH, SEQ = 4, 13  # 13 is odd: sequence parallel must pad to 14 and cut back

# Tolerances. TP changes only the fp32 summation order: row-wise layers add two partial
# matmuls through an all-reduce, attention runs on local heads, the parallel loss takes
# its log-sum-exp over vocabulary shards. Relative to each tensor's largest gradient the
# first-step gradients differ by <= 1.2e-6 (measured); a missing all-reduce, a wrong shard
# or a doubled replicated gradient is an O(1) relative error.
GRAD_TOL = 1e-5  # x max |grad| of the tensor
GRAD_FLOOR = 1e-3
# Through Adam (eps above) a gradient difference dg moves a parameter by <= lr*dg/eps per
# step: dg ~ 1e-6 * 1e-2 gives <= 1e-5 per step in the worst element. Measured max over
# all parameters after 5 steps: 2.7e-6 (8e-6 without clipping). A wrong update moves
# parameters by ~lr = 1e-3 per step, so 4e-5 is 25x below that and ~15x above the noise.
PARAM_ATOL = 4e-5
# Clipping uses the global norm over all shards; it is a sum of squares, so rounding
# differences stay small (measured <= 2.7e-6 relative over 5 steps), while a norm over
# one shard only, or counting replicated gradients twice, is off by ~10-40%.
GNORM_RTOL = 1e-5


# ------------------------------------------------------------------ shared pieces


def make_batch(arch: str) -> tuple[torch.Tensor, torch.Tensor]:
    """input_ids and targets [BATCH, SEQ]; row 0 ends in padding; -100 = nothing to predict."""
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(4, VOCAB, (BATCH, SEQ), generator=g)
    ids[0, -3:] = 1  # padding_idx
    targets = torch.randint(4, VOCAB, (BATCH, SEQ), generator=g)
    if arch.startswith("roberta"):
        targets[torch.rand(BATCH, SEQ, generator=g) > 0.3] = -100  # masked LM: a few positions
    targets[ids == 1] = -100
    return ids, targets


def build(arch: str, dropout: float = 0.0, **overrides) -> torch.nn.Module:
    torch.manual_seed(0)
    return build_model(arch, vocab_size=VOCAB, dropout=dropout, attention_dropout=dropout, **overrides)


def loss_sum(model, arch: str, ids: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Summed cross-entropy, as the trainer computes it (masked LM: logits of masked positions only)."""
    if arch.startswith("roberta"):
        masked = targets.ne(-100)
        logits = model(ids, masked_tokens=masked)
        targets = targets[masked]
    else:
        logits = model(ids)
    return F.cross_entropy(logits.reshape(-1, logits.size(-1)).float(), targets.reshape(-1), ignore_index=-100, reduction="sum")


def train(model, arch, micro_batches, scale, clip, loss_context=contextlib.nullcontext, grad_sync=None, steps=STEPS):
    """AdamW steps over ``micro_batches`` (gradients accumulated); returns per-step norms and first-step grads."""
    opt = torch.optim.AdamW(model.parameters(), lr=LR, eps=EPS)
    gnorms, first_grads = [], None
    for step in range(steps):
        for i, (ids, targets) in enumerate(micro_batches):
            if grad_sync is not None:
                grad_sync(i == len(micro_batches) - 1)
            with loss_context():
                (loss_sum(model, arch, ids, targets) * scale).backward()
        if step == 0:
            first_grads = {n: full(p.grad).clone() for n, p in model.named_parameters()}
        gnorms.append(float(clip(model.parameters(), CLIP)))
        opt.step()
        opt.zero_grad(set_to_none=True)
    return gnorms, first_grads


def reference(arch: str, steps: int = STEPS, **overrides) -> dict:
    """One process, whole batch, torch's own clip_grad_norm_."""
    model = build(arch, **overrides)
    ids, targets = make_batch(arch)
    ntok = int(targets.ne(-100).sum())
    gnorms, grads = train(model, arch, [(ids, targets)], 1.0 / ntok, torch.nn.utils.clip_grad_norm_, steps=steps)
    return {"params": {n: p.detach().clone() for n, p in model.named_parameters()}, "gnorms": gnorms, "grads": grads}


@pytest.fixture(scope="module")
def references(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("tp") / "reference.pt"
    torch.save({arch: reference(arch) for arch in ARCH_NAMES}, path)
    return str(path)


def digest(tensor: torch.Tensor) -> tuple[int, int]:
    """Two int64 checksums of the bits: equal digests mean bitwise-equal tensors (in practice)."""
    bits = tensor.detach().contiguous().view(-1).view(torch.int32).to(torch.int64)
    return int(bits.sum()), int((bits * torch.arange(1, bits.numel() + 1)).sum())


def full(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor


def local(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.to_local() if hasattr(tensor, "to_local") else tensor


def is_sharded(tensor: torch.Tensor) -> bool:
    return any(p.is_shard() for p in getattr(tensor, "placements", ()))


def compare(ref: dict, params: dict, grads: dict, gnorms: list) -> dict:
    """Worst deviations from the reference, each relative to its tolerance's unit."""
    assert params.keys() == ref["params"].keys()
    return {
        "param": max(((params[n] - ref["params"][n]).abs().max().item(), n) for n in params),
        "grads": {n: ((grads[n] - ref["grads"][n]).abs().max().item(), ref["grads"][n].abs().max().item()) for n in grads},
        "gnorm": max(abs(a - b) / b for a, b in zip(gnorms, ref["gnorms"])),
        "gnorms": (gnorms, ref["gnorms"]),
    }


def gradient_error(grads: dict) -> tuple[float, str]:
    """Worst first-step gradient difference, relative to the tensor's largest gradient.

    A few gradients are zero up to rounding (key biases: softmax ignores a shift shared
    by all keys), so each scale is floored at GRAD_FLOOR x the model's largest gradient.
    """
    floor = GRAD_FLOOR * max(scale for _, scale in grads.values())
    return max((diff / max(scale, floor), name) for name, (diff, scale) in grads.items())


def check(result: dict, label: str) -> None:
    param, gnorm = result["param"], result["gnorm"]
    grad, grad_name = gradient_error(result["grads"])
    assert param[0] <= PARAM_ATOL, f"{label}: parameter {param[1]} differs by {param[0]:.3g}"
    assert grad <= GRAD_TOL, f"{label}: first-step gradient of {grad_name} differs by {grad:.3g} x its max"
    assert gnorm <= GNORM_RTOL, f"{label}: gradient norms differ: {result['gnorms']}"


# --------------------------------------------------------------------- tp = 2

# (sequence_parallel, loss_parallel). RoBERTa's loss is never vocabulary-parallel, so it
# needs only both switches off and both on (asking for loss parallel must be harmless).
TP_CONFIGS = {
    "roberta_tiny": [(False, False), (True, True)],
    "llama_tiny": [(False, False), (False, True), (True, False), (True, True)],
}


def _tp_job(reference_path: str) -> dict:
    import torch.distributed as dist
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, set_model_state_dict
    from torch.distributed.device_mesh import init_device_mesh

    from distlm.parallel.tp import apply_tp, clip_grad_norm_, loss_context, tp_info

    refs = torch.load(reference_path, weights_only=True)
    dist.init_process_group("gloo")
    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))
    full = StateDictOptions(full_state_dict=True)
    out: dict = {}
    for arch in ARCH_NAMES:
        ids, targets = make_batch(arch)
        ntok = int(targets.ne(-100).sum())
        for sp, lp in TP_CONFIGS[arch]:
            model = apply_tp(build(arch), mesh, sequence_parallel=sp, loss_parallel=lp)
            gnorms, grads = train(model, arch, [(ids, targets)], 1.0 / ntok, clip_grad_norm_, lambda: loss_context(model))
            params = get_model_state_dict(model, options=full)  # export path: every DTensor gathered
            out[arch, sp, lp] = {
                **compare(refs[arch], params, grads, gnorms),
                "loss_parallel": tp_info(model).loss_parallel,
                "sharded": sorted(n for n, p in model.named_parameters() if is_sharded(p)),
                # Replicated parameters must stay bitwise equal across TP ranks.
                "replicated": {n: digest(local(p)) for n, p in model.named_parameters() if not is_sharded(p)},
            }
        # Loading full (single-device) weights back into the sharded model: resume path.
        # (a copy: set_model_state_dict replaces the values of the dict it is given with DTensors)
        set_model_state_dict(model, dict(refs[arch]["params"]), options=full)
        reloaded = get_model_state_dict(model, options=full)
        out[arch, "reload"] = all(torch.equal(reloaded[n], v) for n, v in refs[arch]["params"].items())

    # Dropout > 0: the TP ranks of a replica must draw the same masks where activations
    # are replicated (here the whole residual stream), or their copies drift apart.
    ids, targets = make_batch("roberta_tiny")
    for same_seed in (True, False):
        model = apply_tp(build("roberta_tiny", dropout=0.1), mesh, sequence_parallel=False, loss_parallel=False)
        torch.manual_seed(1234 if same_seed else 1234 + dist.get_rank())
        train(model, "roberta_tiny", [(ids, targets)], 1e-2, clip_grad_norm_, steps=1)
        out["dropout", same_seed] = digest(torch.cat([local(p).flatten() for p in model.parameters() if not is_sharded(p)]))
    return out


def test_tp2_equals_single_process(references):
    ranks = run_distributed(_tp_job, 2, references, timeout=240)
    for arch in ARCH_NAMES:
        for sp, lp in TP_CONFIGS[arch]:
            result = ranks[0][arch, sp, lp]
            check(result, f"{arch} tp2 sequence_parallel={sp} loss_parallel={lp}")
            assert ranks[1][arch, sp, lp]["replicated"] == result["replicated"]
            # RoBERTa's LM head is tied to a replicated embedding: no vocabulary sharding.
            assert result["loss_parallel"] == (lp and arch == "llama_tiny")
            assert any("embed" in n for n in result["sharded"]) == (arch == "llama_tiny")
        assert ranks[0][arch, "reload"]
    assert ranks[0]["dropout", True] == ranks[1]["dropout", True]
    assert ranks[0]["dropout", False] != ranks[1]["dropout", False]


# ------------------------------------------- tp wider than the key/value heads

# Llama with 8 query heads over 2 key/value heads: at tp 4 each rank holds 2 query heads
# and one key/value head, which 2 ranks share (Llama 3's 32 over 8 at tp 16 or 32 alike).
GQA = {"n_heads": 8, "n_kv_heads": 2}
GQA_STEPS = 2
KV_WEIGHT = "layers.0.attention.wk.weight"


def _gqa_job(reference_path: str, save_dir: str) -> dict:
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    from distlm.checkpoint.stateful import model_state, optimizer_state
    from distlm.mesh import ParallelDims
    from distlm.parallel.api import materialise
    from distlm.parallel.replicas import first_replica_drift
    from distlm.parallel.tp import apply_tp, clip_grad_norm_, loss_context

    ref = torch.load(reference_path, weights_only=True)
    dist.init_process_group("gloo")
    dims = ParallelDims(world_size=4, tp=4)
    mesh = dims.build_mesh("cpu")["tp"]
    ids, targets = make_batch("llama_tiny")
    ntok = int(targets.ne(-100).sum())
    out: dict = {}
    for sp in (False, True):
        if sp:  # the trainer's path for a large model: sharded on meta, filled from rank 0's build
            with torch.device("meta"):
                model = build("llama_tiny", **GQA)
            apply_tp(model, mesh, sequence_parallel=sp, loss_parallel=True)
            materialise(model, torch.device("cpu"), lambda: build("llama_tiny", **GQA))
        else:
            model = apply_tp(build("llama_tiny", **GQA), mesh, sequence_parallel=sp, loss_parallel=True)
        gnorms, grads = train(model, "llama_tiny", [(ids, targets)], 1.0 / ntok, clip_grad_norm_,
                              lambda: loss_context(model), steps=GQA_STEPS)
        params = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))
        kv = model.get_submodule(KV_WEIGHT.rpartition(".")[0]).weight
        out[sp] = {
            **compare(ref, params, grads, gnorms),
            "kv_layout": (tuple(kv.placements), tuple(kv.to_local().shape), kv.device_mesh.mesh_dim_names),
            "kv_digest": digest(kv.to_local()),
            "drift": first_replica_drift(model, dims, "cpu"),
        }
    # A checkpoint as the trainer writes it (each rank its shards), with Adam's moments.
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR, eps=EPS)
    with loss_context(model):
        (loss_sum(model, "llama_tiny", ids, targets) / ntok).backward()
    optimizer.step()
    dcp.save({"model": model_state(model), "optimizer": optimizer_state(model, optimizer)}, checkpoint_id=save_dir)
    out["saved"] = {
        "model": get_model_state_dict(model, options=StateDictOptions(full_state_dict=True)),
        "exp_avg": optimizer.state[kv]["exp_avg"].full_tensor(),
    }
    # One replica of a head drifts: --check-replicas names it.
    with torch.no_grad():
        if dist.get_rank() == 1:
            kv.to_local()[0, 0] += 1.0
    out["drifted"] = first_replica_drift(model, dims, "cpu")
    return out


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")  # dcp.load in one process
def test_tp_wider_than_the_kv_heads_trains_and_saves_each_head_once(tmp_path):
    """tp 4 over 2 key/value heads on 4 processes equals one process; the checkpoint it
    saves holds every head once and loads into one process."""
    import torch.distributed.checkpoint as dcp

    reference_path = tmp_path / "reference.pt"
    torch.save(reference("llama_tiny", steps=GQA_STEPS, **GQA), reference_path)
    save_dir = tmp_path / "checkpoint"
    ranks = run_distributed(_gqa_job, 4, str(reference_path), str(save_dir), timeout=240)
    for sp in (False, True):
        # The tolerances of tp 2 hold: replicating a head adds only the all-reduce of its
        # replicas' gradients, another fp32 summation order. Forgetting that sum (or
        # summing a head with a neighbour's) leaves an O(1) error in every wk/wv gradient.
        check(ranks[0][sp], f"llama_tiny tp4 over 2 kv heads sequence_parallel={sp}")
        placements, local_shape, mesh_dims = ranks[0][sp]["kv_layout"]
        assert placements == (Shard(0), Replicate()) and mesh_dims == ("tp_kv", "tp_kv_replica")
        assert local_shape == (192 // 8, 192)  # one head of head_dim 24 per rank
        # Ranks 0, 1 share head 0 and ranks 2, 3 head 1: copies bitwise equal, heads differ.
        digests = [rank[sp]["kv_digest"] for rank in ranks]
        assert digests[0] == digests[1] and digests[2] == digests[3] and digests[0] != digests[2]
        assert all(rank[sp]["drift"] is None for rank in ranks)
    assert ranks[0]["drifted"] == f"parameter {KV_WEIGHT} differs between key/value head replica ranks 0 and 1"

    # Each head once: the two replicas of a head were written as one chunk, in the
    # single-device shape, and one process (no process group) reads them back.
    metadata = dcp.FileSystemReader(str(save_dir)).read_metadata().state_dict_metadata
    chunks = metadata[f"model.{KV_WEIGHT}"].chunks
    assert tuple(metadata[f"model.{KV_WEIGHT}"].size) == (2 * 24, 192)
    assert sorted((tuple(c.offsets), tuple(c.sizes)) for c in chunks) == [((0, 0), (24, 192)), ((24, 0), (24, 192))]
    single = build("llama_tiny", **GQA)
    state = {"model": single.state_dict()}
    dcp.load(state, checkpoint_id=str(save_dir), no_dist=True)
    saved = ranks[0]["saved"]
    assert all(torch.equal(state["model"][name], saved["model"][name]) for name in saved["model"])
    exp_avg = torch.empty(2 * 24, 192)
    dcp.load({f"optimizer.{KV_WEIGHT}.exp_avg": exp_avg}, checkpoint_id=str(save_dir), no_dist=True)
    assert torch.equal(exp_avg, saved["exp_avg"])


# ------------------------------------------------------------------ no processes


def test_validate_tp_names_flag_and_dimension():
    with torch.device("meta"):
        llama, roberta_tiny = build_model("llama_tiny", vocab_size=VOCAB), build_model("roberta_tiny", vocab_size=VOCAB)
        roberta = build_model("roberta_tiny", vocab_size=VOCAB, n_heads=6, ffn_dim=771)
        short = build_model("roberta_tiny", vocab_size=VOCAB, max_positions=510)
    validate_tp(llama, 2, arch="llama_tiny")
    validate_tp(roberta_tiny, 4, arch="roberta_tiny")
    with pytest.raises(UsageError, match=r"^--tp-degree 4 does not divide n_heads 6 of --arch llama_tiny$"):
        validate_tp(llama, 4, arch="llama_tiny")
    with pytest.raises(UsageError, match=r"^--tp-degree 3 neither divides nor is a multiple of n_kv_heads 2 "
                                         r"of --arch llama_tiny; choose a divisor or a multiple of 2$"):
        validate_tp(llama, 3, arch="llama_tiny")
    with torch.device("meta"):
        gqa = build_model("llama_tiny", vocab_size=VOCAB, **GQA)
    validate_tp(gqa, 4)  # past the 2 key/value heads: each is replicated on 2 ranks
    validate_tp(gqa, 8)
    with pytest.raises(UsageError, match="does not divide ffn_dim 771 of RobertaMaskedLM"):
        validate_tp(roberta, 2)
    validate_tp(short, 4, sequence_parallel=True, tokens_per_sample=508)
    with pytest.raises(UsageError, match="pads --tokens-per-sample 509 to 512, .* beyond the 510 positions"):
        validate_tp(short, 4, sequence_parallel=True, tokens_per_sample=509)
    with pytest.raises(UsageError, match="declares no tp_plan"):
        validate_tp(torch.nn.Linear(4, 4), 2)
    validate_tp(torch.nn.Linear(4, 4), 1)  # degree 1: tensor parallel is off


@pytest.mark.parametrize("arch", arch_names())
def test_tp_plan_entries_name_real_modules_of_their_kind(arch):
    with torch.device("meta"):
        model = build_model(arch, vocab_size=VOCAB, n_layers=2)
    plan = model_tp_plan(model)  # an instance's own: a tied Llama's, a mixture of experts' without dense layers
    assert set(plan.values()) <= set(STYLES)
    kinds = {
        "colwise": torch.nn.Linear, "colwise_kv": torch.nn.Linear, "rowwise": torch.nn.Linear,
        "colwise_output": torch.nn.Linear,
        "vocab_embedding": torch.nn.Embedding, "sequence_norm": (torch.nn.LayerNorm, torch.nn.RMSNorm),
        "sequence_region": torch.nn.ModuleList, "sequence_gather": torch.nn.Module, "head_norm": torch.nn.RMSNorm,
    }
    modules = dict(model.named_modules())
    for pattern, style in plan.items():
        regex = re.compile(re.escape(pattern).replace(r"\*", r"\d+") + "$")
        matched = [module for name, module in modules.items() if regex.match(name)]
        assert matched and all(isinstance(m, kinds[style]) for m in matched), pattern


@pytest.mark.parametrize("world, tp", [(64, 32), (16, 16)])
def test_llama3_heads_at_tp_16_and_32_with_the_fake_process_group(world, tp):
    """Llama 3 8B's 32 query heads over 8 key/value heads: each rank's query heads read the
    key/value head it holds, shared by tp / 8 consecutive ranks (shapes only, on meta)."""
    import torch.distributed as dist
    from torch.distributed.tensor.debug import _clear_sharding_prop_cache
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from distlm.mesh import ParallelDims
    from distlm.parallel.tp import apply_tp

    store = FakeStore()
    for rank in (0, 13, world - 1):
        # DTensor caches sharding results by mesh value, which ignores the rank: one
        # process playing several ranks must drop them, or it gets rank 0's meshes back.
        _clear_sharding_prop_cache()
        dist.init_process_group("fake", store=store, rank=rank, world_size=world)
        try:
            mesh = ParallelDims(world_size=world, tp=tp).build_mesh("cpu")
            with torch.device("meta"):
                model = build_model("llama3_8b", n_layers=1)
            apply_tp(model, mesh["tp"], sequence_parallel=False, loss_parallel=True)
            attention = model.layers[0].attention
            layout = {}
            for name in ("wq", "wk", "wv"):
                weight = getattr(attention, name).weight
                # (local shape, first head): rows are sharded along the first mesh dimension.
                rows = weight.to_local().shape[0]
                layout[name] = (tuple(weight.to_local().shape), weight.device_mesh.get_coordinate()[0] * rows // 128)
            tp_rank, replicas = rank % tp, tp // 8
            assert layout["wq"] == ((32 // tp * 128, 4096), tp_rank * 32 // tp)
            # Query head h reads key/value head h // 4: the rank's first query head's.
            assert layout["wk"] == layout["wv"] == ((128, 4096), tp_rank // replicas) == ((128, 4096), layout["wq"][1] // 4)
            group = attention.wk.weight.device_mesh.get_group("tp_kv_replica")
            first = rank - rank % replicas
            assert dist.get_process_group_ranks(group) == list(range(first, first + replicas))
        finally:
            dist.destroy_process_group()
