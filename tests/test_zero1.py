"""ZeRO-1 (distlm.parallel.zero1) equals single-process AdamW, with its state really sharded.

Each job trains 5 updates of the same global batch on real gloo processes and the test
compares with a single-process AdamW reference computed here. One spawned job checks
several things at once (parity, replicas, sharding, memory, checkpoint round trip), to
keep the process count low on a 2-core machine. Checkpoints go through the sharded path
the Checkpointer uses (distlm/checkpoint/stateful.py with torch.distributed.checkpoint):
each rank writes and reads only the partition it holds.
"""

from __future__ import annotations

import copy
import os
import subprocess
import sys
import warnings

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn.functional as F

from distributed import run_distributed
from distlm.config import OptimConfig
from distlm.models import build_model
from distlm.optim import AdamWSettings, LRSchedule, build_optimizer

UPDATES = 5
SAVE_AT = 3  # the checkpoint is taken after this update and resumed for the rest
VOCAB = 64
GLOBAL_BATCH = 8
SEQ = 32

# Tolerance against the single-process reference: as in test_ddp, the data-parallel
# gradient is the sum of two half-batch gradients where one process reduces the whole
# batch inside its matmuls, so gradients differ by fp32 reassociation (~1e-7 relative);
# Adam's division by sqrt(v) amplifies that on rows with tiny gradients, to ~2e-7 after
# 5 updates. Tensor parallel adds the same kind of reassociation (row-wise partial sums
# all-reduced over tp). One update more or less moves parameters by ~1e-4-1e-3 (lr 1e-3),
# so 5e-6 keeps a wide margin on both sides.
PARAM_ATOL = 5e-6


def optim_config() -> OptimConfig:
    # adam_eps 1e-6, the value PARAM_ATOL was derived with: Adam's eps bounds how far it
    # amplifies the reassociation noise of near-zero gradients, and at fairseq's 1e-8 a
    # single element of 98304 drifted 8e-6 from the reference after 5 updates (tp test).
    return OptimConfig(lr=1e-3, warmup_updates=2, max_update=100, clip_norm=1.0, adam_eps=1e-6)


def global_batch(update: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The global batch of 1-based ``update``: tokens and targets, ~25% of targets ignored
    (so the two halves hold different target counts and the global normalisation matters)."""
    g = torch.Generator().manual_seed(1000 + update)
    tokens = torch.randint(4, VOCAB, (GLOBAL_BATCH, SEQ), generator=g)
    targets = torch.randint(4, VOCAB, (GLOBAL_BATCH, SEQ), generator=g)
    targets[torch.rand(GLOBAL_BATCH, SEQ, generator=g) < 0.25] = -100
    return tokens, targets


def new_model(arch: str, seed: int = 3) -> torch.nn.Module:
    """As the Trainer builds it: meta, then materialised and initialised from one seed."""
    with torch.device("meta"):
        model = build_model(arch, vocab_size=VOCAB, padding_idx=1, dropout=0.0, attention_dropout=0.0)
    model.to_empty(device="cpu")
    torch.manual_seed(seed)
    with torch.no_grad():
        model.init_weights()
    return model


def loss_sum(model: torch.nn.Module, tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    logits = model(tokens)
    return F.cross_entropy(logits.reshape(-1, logits.size(-1)).float(), targets.reshape(-1), ignore_index=-100, reduction="sum")


def reference(arch: str) -> dict:
    """Single process, plain AdamW (distlm.optim), whole global batch."""
    cfg = optim_config()
    model = new_model(arch)
    optimizer = build_optimizer(model.parameters(), AdamWSettings.from_config(cfg), torch.float32)
    schedule = LRSchedule(cfg)
    out = {}
    for update in range(1, UPDATES + 1):
        tokens, targets = global_batch(update)
        (loss_sum(model, tokens, targets) / int(targets.ne(-100).sum())).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.clip_norm, foreach=True)
        schedule.apply(optimizer, update)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if update == SAVE_AT:
            out["model_at_save"] = {n: p.detach().clone() for n, p in model.named_parameters()}
            out["optimizer_at_save"] = copy.deepcopy(optimizer.state_dict())
    out["params"] = {n: p.detach().clone() for n, p in model.named_parameters()}
    return out


# ---------------------------------------------------------------- 2 ranks: ZeRO-1 + DDP


def _train_ddp(model, optimizer, schedule, first: int, last: int, on_update=None) -> None:
    """Updates ``first..last`` as the Trainer runs them: loss x dp / global target tokens (DDP averages), clip, step."""
    rank, world = dist.get_rank(), dist.get_world_size()
    per_rank = GLOBAL_BATCH // world
    for update in range(first, last + 1):
        tokens, targets = global_batch(update)
        global_targets = int(targets.ne(-100).sum())
        mine = slice(rank * per_rank, (rank + 1) * per_rank)
        (loss_sum(model, tokens[mine], targets[mine]) * world / global_targets).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), optim_config().clip_norm, foreach=True)
        schedule.apply(optimizer, update)
        optimizer.step()
        if on_update is not None:
            on_update(update)
        optimizer.zero_grad(set_to_none=True)


def read_checkpoint(path: str) -> dict[str, torch.Tensor]:
    """Every tensor of a DCP checkpoint, whole, in one process (the test's own reader)."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    saved = dcp.FileSystemReader(path).read_metadata().state_dict_metadata
    state = {key: torch.empty(meta.size, dtype=meta.properties.dtype)
             for key, meta in saved.items() if isinstance(meta, TensorStorageMetadata)}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # "assuming the intent is to load in a single process"
        dcp.load(state, checkpoint_id=path, no_dist=True)
    return state


def save_sharded(model: torch.nn.Module, optimizer: torch.optim.Optimizer, path: str) -> None:
    """What the Checkpointer saves of model and optimizer: each rank its own shards (collective)."""
    from distlm.checkpoint.stateful import model_state, optimizer_state

    dcp.save({"model": model_state(model), "optimizer": optimizer_state(model, optimizer)}, checkpoint_id=path)


def load_sharded(model: torch.nn.Module, optimizer: torch.optim.Optimizer, path: str) -> None:
    """What the Checkpointer loads: each rank reads the slices of its own shards (collective)."""
    from distlm.checkpoint.stateful import load_model_state, model_state, optimizer_state_to_load

    saved = set(dcp.FileSystemReader(path).read_metadata().state_dict_metadata)
    state = {"model": model_state(model), "optimizer": optimizer_state_to_load(model, optimizer, saved)}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # one process: "assuming the intent is to load in a single process"
        dcp.load(state, checkpoint_id=path, no_dist=not dist.is_initialized())
    load_model_state(model, state["model"])


def saved_moments(saved: dict[str, torch.Tensor], names: list[str]) -> dict[int, dict[str, torch.Tensor]]:
    """The checkpoint's Adam state in ``AdamW.state_dict()`` form: keyed by parameter index."""
    return {index: {field: saved[f"optimizer.{name}.{field}"] for field in ("step", "exp_avg", "exp_avg_sq")}
            for index, name in enumerate(names)}


def _zero1_job(archs: list[str], save_dir: str) -> dict:
    """Both archs in one spawned job (fewer processes on 2 cores)."""
    dist.init_process_group("gloo")
    out = {arch: _zero1_run(arch, os.path.join(save_dir, arch)) for arch in archs}
    out["fp16"] = _zero1_fp16_run(os.path.join(save_dir, "fp16"))
    out["frozen"] = _zero1_frozen_checkpoint_run(save_dir)
    return out


def _zero1_run(arch: str, save_path: str) -> dict:
    from distlm.training.memory import memory_report, optimizer_state_bytes
    from distlm.parallel.ddp import apply_ddp
    from distlm.parallel.zero1 import Zero1Optimizer, build_zero1_optimizer

    rank = dist.get_rank()
    cfg = optim_config()
    cpu = torch.device("cpu")
    out: dict = {}

    # Baseline in the same job: DDP + plain AdamW.
    baseline = new_model(arch)
    ddp = apply_ddp(baseline, cpu, dist.group.WORLD, 25.0)
    _train_ddp(ddp, build_optimizer(ddp.parameters(), AdamWSettings.from_config(cfg), torch.float32), LRSchedule(cfg), 1, UPDATES)
    out["baseline"] = {n: p.detach().clone() for n, p in baseline.named_parameters()}

    model = new_model(arch)
    ddp = apply_ddp(model, cpu, dist.group.WORLD, 25.0)
    optimizer = build_zero1_optimizer(ddp.parameters(), AdamWSettings.from_config(cfg), dist.group.WORLD, torch.float32)
    assert isinstance(optimizer, Zero1Optimizer)
    names = {p: n for n, p in model.named_parameters()}

    def on_update(update: int) -> None:
        if update == 1:  # gradients still alive: the memory report counts them
            out["memory"] = memory_report(ddp, optimizer)
        if update == SAVE_AT:
            save_sharded(ddp, optimizer, save_path)
            # torch's own route (gather everything to one rank) is the reference for what was saved.
            optimizer.consolidate_state_dict(to=0)
            if rank == 0:  # a copy: the state of rank 0's own partition is the live tensors
                out["stock_at_save"] = copy.deepcopy(optimizer.state_dict())
            dist.barrier()

    _train_ddp(ddp, optimizer, LRSchedule(cfg), 1, UPDATES, on_update)
    out["params"] = {n: p.detach().clone() for n, p in model.named_parameters()}
    out["owned"] = sorted(names[p] for p in optimizer.state)
    out["numel"] = {n: p.numel() for n, p in model.named_parameters()}
    out["state_bytes"] = optimizer_state_bytes(optimizer)

    # Resume from the checkpoint into a differently initialised model: every rank reads its partition.
    resumed = new_model(arch, seed=99)
    ddp = apply_ddp(resumed, cpu, dist.group.WORLD, 25.0)
    optimizer = build_zero1_optimizer(ddp.parameters(), AdamWSettings.from_config(cfg), dist.group.WORLD, torch.float32)
    load_sharded(ddp, optimizer, save_path)
    resumed_names = {p: n for n, p in resumed.named_parameters()}
    out["resumed_owned"] = sorted(resumed_names[p] for p in optimizer.state)
    _train_ddp(ddp, optimizer, LRSchedule(cfg), SAVE_AT + 1, UPDATES)
    out["resumed"] = {n: p.detach().clone() for n, p in resumed.named_parameters()}
    return out


def _zero1_fp16_run(path: str) -> dict:
    """--memory-efficient-fp16: fp16 weights, fp32 moments that stay fp32 through a checkpoint."""
    from distlm.parallel.zero1 import build_zero1_optimizer

    cfg = optim_config()
    torch.manual_seed(0)
    half = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 4)).half()

    def build():
        return build_zero1_optimizer(half.parameters(), AdamWSettings.from_config(cfg), dist.group.WORLD, torch.float16)

    optimizer = build()
    for p in half.parameters():
        p.grad = torch.full_like(p, 1e-3)  # as if all-reduced: the same on every rank
    optimizer.step()
    save_sharded(half, optimizer, path)
    resumed = build()
    load_sharded(half, resumed, path)
    out = {
        "same_partition": resumed.state.keys() == optimizer.state.keys(),
        "same_moments": all(torch.equal(resumed.state[p][k], optimizer.state[p][k])
                            for p in optimizer.state for k in ("step", "exp_avg", "exp_avg_sq")),
    }
    resumed.step()
    return {
        **out,
        "inner": type(resumed.optim).__name__,
        "moments": sorted({str(v.dtype) for entry in resumed.state.values() for k, v in entry.items() if k != "step"}),
        "params": [p.detach().clone() for p in half.parameters()],
    }


def _zero1_frozen_checkpoint_run(save_dir: str) -> dict:
    """A frozen parameter (here the first, the token embedding) has no optimizer state and no
    ZeRO-1 index: the checkpoint must still key every Adam moment by its own parameter's name."""
    from distlm.checkpoint.stateful import model_state, optimizer_state, optimizer_state_to_load
    from distlm.parallel.ddp import apply_ddp
    from distlm.parallel.zero1 import build_zero1_optimizer

    def build():
        model = new_model("llama_tiny")
        model.tok_embeddings.weight.requires_grad_(False)
        ddp = apply_ddp(model, torch.device("cpu"), dist.group.WORLD, 25.0)
        return ddp, build_zero1_optimizer(ddp.parameters(), AdamWSettings.from_config(optim_config()), dist.group.WORLD, torch.float32)

    ddp, optimizer = build()
    _train_ddp(ddp, optimizer, LRSchedule(optim_config()), 1, 2)
    path = os.path.join(save_dir, "frozen")
    dcp.save({"model": model_state(ddp), "optimizer": optimizer_state(ddp, optimizer)}, checkpoint_id=path)
    saved = dcp.FileSystemReader(path).read_metadata().state_dict_metadata
    resumed, resumed_optimizer = build()
    dcp.load({"optimizer": optimizer_state_to_load(resumed, resumed_optimizer, set(saved))}, checkpoint_id=path)
    names = {p: n for n, p in resumed.module.named_parameters()}
    return {
        "moment_shapes": {key.removeprefix("optimizer.").removesuffix(".exp_avg"): tuple(meta.size)
                          for key, meta in saved.items() if key.endswith(".exp_avg")},
        "param_shapes": {n: tuple(p.shape) for n, p in ddp.module.named_parameters() if p.requires_grad},
        "own": {n: optimizer.state[p]["exp_avg"] for n, p in ddp.module.named_parameters() if p in optimizer.state},
        "resumed": {names[p]: entry["exp_avg"] for p, entry in resumed_optimizer.state.items()},
    }


def test_zero1_two_ranks_equal_single_process(tmp_path):
    archs = ["roberta_tiny", "llama_tiny"]
    results = run_distributed(_zero1_job, 2, archs, str(tmp_path))
    fp16 = [r["fp16"] for r in results]
    assert fp16[0]["inner"] == "Fp32StateAdamW" and fp16[0]["moments"] == ["torch.float32"]
    assert all(r["same_moments"] and r["same_partition"] for r in fp16)
    assert all(torch.equal(a, b) for a, b in zip(fp16[0]["params"], fp16[1]["params"]))
    for arch in archs:
        _check_two_ranks(arch, [r[arch] for r in results], str(tmp_path / arch))
    for frozen in (r["frozen"] for r in results):
        assert frozen["moment_shapes"] == frozen["param_shapes"]
        assert frozen["own"].keys() == frozen["resumed"].keys() and frozen["own"]
        assert all(torch.equal(frozen["own"][n], frozen["resumed"][n]) for n in frozen["own"])


def _check_two_ranks(arch: str, ranks: list[dict], checkpoint_path: str) -> None:
    expected = reference(arch)
    saved = read_checkpoint(checkpoint_path)
    names = [name for name, _ in new_model(arch).named_parameters()]

    for result in ranks:
        for name, value in expected["params"].items():
            torch.testing.assert_close(result["params"][name], value, rtol=0, atol=PARAM_ATOL, msg=lambda m: f"{arch} {name}: {m}")
            # ZeRO-1 runs AdamW's own elementwise arithmetic on the same all-reduced
            # gradients, only on a subset of the tensors: bit-identical to DDP + AdamW.
            assert torch.equal(result["params"][name], result["baseline"][name]), name
            # Replicas agree exactly.
            assert torch.equal(result["params"][name], ranks[0]["params"][name]), name
        # The checkpoint round trip continues bit-identically.
        for name, value in result["params"].items():
            assert torch.equal(result["resumed"][name], value), f"{name} after resume"

    # Sharded: each parameter's state lives on exactly one rank, and resuming keeps the partition.
    owned = [set(r["owned"]) for r in ranks]
    assert owned[0].isdisjoint(owned[1]) and owned[0] | owned[1] == set(expected["params"])
    assert [set(r["resumed_owned"]) for r in ranks] == owned

    # Memory. fp32 Adam holds two moments (8 bytes per element) plus a 4-byte step per tensor.
    numel = ranks[0]["numel"]
    psi, n = sum(numel.values()), 2
    held = [8 * sum(numel[name] for name in own) + 4 * len(own) for own in owned]
    for result, expected_bytes in zip(ranks, held):
        assert result["state_bytes"] == expected_bytes
        assert result["memory"]["optimizer_bytes"] == expected_bytes  # distlm.training.memory agrees
    assert sum(held) == 8 * psi + 4 * len(numel)  # together: exactly one plain AdamW state
    # The ZeRO paper's 8Ψ/N assumes an even split; torch partitions whole tensors, largest
    # first, each to the least-loaded rank. The rank that ends largest received its last
    # tensor p when it was least loaded (<= (Ψ - p)/N), so it holds at most
    # Ψ/N + (1 - 1/N)·p <= Ψ/N + (1 - 1/N)·p_max elements.
    bound = 8 * (psi / n + (1 - 1 / n) * max(numel.values())) + 4 * len(numel)
    assert max(held) <= bound
    assert max(held) < 0.75 * (8 * psi)  # and it does shard: far below one full copy

    # The checkpoint holds each parameter whole and every Adam moment under the parameter's
    # name, exactly what torch's own gather-everything route (consolidate_state_dict) gives...
    assert {key for key in saved if key.startswith("model.")} == {f"model.{name}" for name in names}
    assert {key for key in saved if key.startswith("optimizer.")} == {
        f"optimizer.{name}.{field}" for name in names for field in ("step", "exp_avg", "exp_avg_sq")}
    moments, stock, plain = saved_moments(saved, names), ranks[0]["stock_at_save"], expected["optimizer_at_save"]
    assert stock["state"].keys() == moments.keys() == plain["state"].keys()
    for index, entry in plain["state"].items():
        assert moments[index].keys() == entry.keys()
        assert all(torch.equal(moments[index][field], stock["state"][index][field]) for field in entry)
        assert torch.equal(moments[index]["step"], entry["step"])
        # ...and the moments of a single process. They follow the gradients, which differ
        # from the reference by fp32 reassociation; the absolute floor covers near-zero entries.
        torch.testing.assert_close(moments[index]["exp_avg"], entry["exp_avg"], rtol=1e-3, atol=1e-8)
        torch.testing.assert_close(moments[index]["exp_avg_sq"], entry["exp_avg_sq"], rtol=1e-3, atol=1e-12)
    for name in names:
        torch.testing.assert_close(saved[f"model.{name}"], expected["model_at_save"][name], rtol=0, atol=PARAM_ATOL)

    # So a single process (or DDP) resumes from a ZeRO-1 checkpoint.
    model = new_model(arch, seed=99)
    optimizer = build_optimizer(model.parameters(), AdamWSettings.from_config(optim_config()), torch.float32)
    load_sharded(model, optimizer, checkpoint_path)
    schedule = LRSchedule(optim_config())
    for update in range(SAVE_AT + 1, UPDATES + 1):
        tokens, targets = global_batch(update)
        (loss_sum(model, tokens, targets) / int(targets.ne(-100).sum())).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), optim_config().clip_norm, foreach=True)
        schedule.apply(optimizer, update)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.detach(), expected["params"][name], rtol=0, atol=PARAM_ATOL, msg=lambda m: f"{name}: {m}")


# ---------------------------------------------------- 4 ranks: ZeRO-1 + tensor parallel


def _tp_plan() -> dict:
    """A Megatron-style plan for llama_tiny in torch's own styles (independent of distlm.parallel.tp):
    vocabulary-sharded embedding and output, column-wise Q/K/V/w1/w3, row-wise wo/w2; norms stay plain tensors."""
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    plan = {
        "tok_embeddings": RowwiseParallel(input_layouts=Replicate()),
        "output": ColwiseParallel(output_layouts=Replicate()),
    }
    for name in ("attention.wq", "attention.wk", "attention.wv", "feed_forward.w1", "feed_forward.w3"):
        plan[f"layers.*.{name}"] = ColwiseParallel()
    for name in ("attention.wo", "feed_forward.w2"):
        plan[f"layers.*.{name}"] = RowwiseParallel()
    return plan


def _full_params(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    from torch.distributed.tensor import DTensor

    return {n: (p.full_tensor() if isinstance(p, DTensor) else p).detach().clone() for n, p in model.named_parameters()}


def _tp_zero1_job(arch: str, save_path: str) -> dict:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor.experimental import implicit_replication
    from torch.distributed.tensor.parallel import parallelize_module

    from distlm.training.memory import memory_report, optimizer_state_bytes
    from distlm.parallel.zero1 import Zero1Optimizer, build_zero1_optimizer

    dist.init_process_group("gloo")
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    dp_group, dp_rank, dp = mesh["dp"].get_group(), mesh["dp"].get_local_rank(), 2
    cfg = optim_config()

    def build(seed: int):
        model = new_model(arch, seed)
        parallelize_module(model, mesh["tp"], _tp_plan())
        optimizer = build_zero1_optimizer(model.parameters(), AdamWSettings.from_config(cfg), dp_group, torch.float32)
        assert isinstance(optimizer, Zero1Optimizer)
        return model, optimizer

    def train(model, optimizer, first: int, last: int, on_update=None) -> None:
        schedule = LRSchedule(cfg)
        per_rank = GLOBAL_BATCH // dp
        for update in range(first, last + 1):
            tokens, targets = global_batch(update)
            mine = slice(dp_rank * per_rank, (dp_rank + 1) * per_rank)
            (loss_sum(model, tokens[mine], targets[mine]) * dp / int(targets.ne(-100).sum())).backward()
            # What DDP does for the replicas: average the (local shards of the) gradients over dp.
            grads = [p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad for p in model.parameters()]
            flat = torch.cat([g.reshape(-1) for g in grads])
            dist.all_reduce(flat, group=dp_group)
            flat.div_(dp)
            torch._foreach_copy_(grads, [t.view_as(g) for t, g in zip(flat.split([g.numel() for g in grads]), grads)])
            with implicit_replication():  # norms are plain tensors, the rest DTensors
                torch.nn.utils.clip_grad_norm_(list(model.parameters()), cfg.clip_norm, foreach=True)
            schedule.apply(optimizer, update)
            optimizer.step()
            if on_update is not None:
                on_update(update)
            optimizer.zero_grad(set_to_none=True)

    out: dict = {}
    model, optimizer = build(3)
    names = {p: n for n, p in model.named_parameters()}

    def on_update(update: int) -> None:
        if update == 1:
            out["memory"] = memory_report(model, optimizer)
        if update == SAVE_AT:
            save_sharded(model, optimizer, save_path)  # each (dp, tp) rank writes its own slices

    train(model, optimizer, 1, UPDATES, on_update)
    out["params"] = _full_params(model)
    out["local"] = {n: (p.to_local() if isinstance(p, DTensor) else p).detach().clone() for n, p in model.named_parameters()}
    out["dtensor"] = sorted(n for n, p in model.named_parameters() if isinstance(p, DTensor))
    out["owned"] = sorted(names[p] for p in optimizer.state)
    out["local_numel"] = {n: t.numel() for n, t in out["local"].items()}
    out["state_bytes"] = optimizer_state_bytes(optimizer)

    resumed, optimizer = build(99)
    load_sharded(resumed, optimizer, save_path)
    out["resumed_owned"] = sorted(n for n, p in resumed.named_parameters() if p in optimizer.state)
    train(resumed, optimizer, SAVE_AT + 1, UPDATES)
    out["resumed"] = {n: (p.to_local() if isinstance(p, DTensor) else p).detach().clone() for n, p in resumed.named_parameters()}
    out["coords"] = (dp_rank, mesh["tp"].get_local_rank())
    return out


def test_zero1_with_tensor_parallel_dp2_tp2(tmp_path):
    arch = "llama_tiny"
    expected = reference(arch)
    ranks = run_distributed(_tp_zero1_job, 4, arch, str(tmp_path / "checkpoint"), timeout=180)
    assert [r["coords"] for r in ranks] == [(0, 0), (0, 1), (1, 0), (1, 1)]
    assert ranks[0]["dtensor"] and len(ranks[0]["dtensor"]) < len(expected["params"])  # a mixed model

    for result in ranks:
        for name, value in expected["params"].items():
            torch.testing.assert_close(result["params"][name], value, rtol=0, atol=PARAM_ATOL, msg=lambda m: f"{name}: {m}")
        for name, value in result["local"].items():
            assert torch.equal(result["resumed"][name], value), f"{name} after resume"
    for tp_rank in (0, 1):
        first, second = ranks[tp_rank], ranks[2 + tp_rank]  # the two dp replicas of one tp shard
        for name, value in first["local"].items():
            assert torch.equal(value, second["local"][name]), name

    for tp_rank in (0, 1):
        first, second = ranks[tp_rank], ranks[2 + tp_rank]
        # Every tp rank of a dp rank owns the same parameters, and the dp ranks split them.
        assert first["owned"] == ranks[0]["owned"] and second["owned"] == ranks[2]["owned"]
        assert set(first["owned"]).isdisjoint(second["owned"])
        assert set(first["owned"]) | set(second["owned"]) == set(expected["params"])
        # Memory from the local shards: together one AdamW state of this tp rank's shard, 8Ψ_tp + 4 per tensor.
        numel = first["local_numel"]
        held = [8 * sum(numel[n] for n in r["owned"]) + 4 * len(r["owned"]) for r in (first, second)]
        assert [first["state_bytes"], second["state_bytes"]] == held
        assert [first["memory"]["optimizer_bytes"], second["memory"]["optimizer_bytes"]] == held
        assert sum(held) == 8 * sum(numel.values()) + 4 * len(numel)
        assert max(held) < 0.75 * 8 * sum(numel.values())

        assert first["resumed_owned"] == first["owned"] and second["resumed_owned"] == second["owned"]

    # The checkpoint holds whole tensors under single-device names, the moments of one process.
    names = list(expected["params"])
    saved = read_checkpoint(str(tmp_path / "checkpoint"))
    moments, plain = saved_moments(saved, names), expected["optimizer_at_save"]
    assert {key for key in saved if key.startswith("optimizer.")} == {
        f"optimizer.{name}.{field}" for name in names for field in ("step", "exp_avg", "exp_avg_sq")}
    for index, entry in plain["state"].items():
        assert torch.equal(moments[index]["step"], entry["step"])
        torch.testing.assert_close(moments[index]["exp_avg"], entry["exp_avg"], rtol=1e-3, atol=1e-8)
        torch.testing.assert_close(moments[index]["exp_avg_sq"], entry["exp_avg_sq"], rtol=1e-3, atol=1e-12)
    for name in names:
        torch.testing.assert_close(saved[f"model.{name}"], expected["model_at_save"][name], rtol=0, atol=PARAM_ATOL)


# ------------------------------------------------------------------------ no processes


def test_one_process_gets_plain_adamw():
    from distlm.parallel.zero1 import build_zero1_optimizer

    model = torch.nn.Linear(4, 4)
    optimizer = build_zero1_optimizer(model.parameters(), AdamWSettings.from_config(optim_config()), None, torch.float32)
    assert type(optimizer) is torch.optim.AdamW


def test_only_zero1_loads_torch_distributed_optim():
    """torch.distributed.optim scripts its functional optimizers as it loads, a cost at every
    start-up: the trainer and the strategies' handle import it only when ZeRO-1 builds its
    optimizer (test_strategies trains under --strategy zero1 through that handle)."""
    code = ("import sys\nfrom distlm.training.trainer import Trainer\n"
            "from distlm.parallel.handle import DataParallelHandle\n"
            "print('torch.distributed.optim' in sys.modules)\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=240)
    assert proc.stdout.split() == ["False"], proc.stdout + proc.stderr
