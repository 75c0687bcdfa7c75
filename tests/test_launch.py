"""End-to-end launches: the README demo under torchrun, fairseq-style explicit ranks,
``--check-replicas``, ``--num-workers`` and resuming on another world size.

Every reference is computed here: a torchrun-style run of the test harness for the
explicit launch, a single process for the data loader and the world-size change.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from distributed import run_distributed
from distlm import checkpoint
from distlm.config import parse_args
from distlm.launch import devices as env_module
from distlm.launch.devices import device_index
from distlm.launch.hosts import find_free_port
from distlm.errors import UsageError
from distlm.state.names import unwrap
from distlm.training.trainer import Trainer

# A subprocess that takes longer than this is hung; a normal run takes 5-20 s here.
SUBPROCESS_TIMEOUT = 240


def fit(args: list[str]) -> dict:
    return Trainer(parse_args(args)).fit()


def args_for(data: str, save_dir: Path, max_update: int, batch_size: int, extra: list[str] = ()) -> list[str]:
    # Dropout 0 so that the DDP and single-process runs differ only in reduction order;
    # --total-num-update fixed so a 4-update run has the LR schedule of the 8-update one.
    return [
        "--data", data, "--arch", "roberta_tiny", "--tokens-per-sample", "32",
        "--batch-size", str(batch_size), "--dropout", "0", "--attention-dropout", "0",
        "--lr", "1e-3", "--warmup-updates", "2", "--total-num-update", "8",
        "--max-update", str(max_update), "--log-interval", "1000", "--save-dir", str(save_dir),
        "--device", "cpu", "--seed", "3", "--timeout-sec", "60", *extra,
    ]


def subprocess_env(**extra: str) -> dict[str, str]:
    # conftest.py already removed every launcher variable from os.environ.
    return {**os.environ, "OMP_NUM_THREADS": "1", **extra}


def last_checkpoint(save_dir: Path) -> dict:
    return checkpoint.load(save_dir / checkpoint.LAST)


def assert_models_identical(actual: dict, expected: dict) -> None:
    assert actual.keys() == expected.keys()
    for name, value in expected.items():
        assert actual[name].dtype == value.dtype, name
        assert torch.equal(actual[name], value), name


def test_bad_input_under_torchrun_is_one_line_from_rank_0(tmp_path):
    """Both ranks meet the bad --tp-degree before any rendezvous. Rank 0 reports it; rank 1
    must not exit first, or torchrun stops rank 0 before it has printed anything."""
    command = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
        "-m", "distlm.train", "--tp-degree", "3", "--no-save", "--device", "cpu",
    ]
    proc = subprocess.run(command, cwd=tmp_path, capture_output=True, text=True, timeout=SUBPROCESS_TIMEOUT,
                          env=subprocess_env(DISTLM_CACHE_DIR=str(tmp_path / "cache")))
    errors = [line for line in proc.stderr.splitlines() if line.startswith("distlm: error:")]
    assert proc.returncode != 0
    assert errors == ["distlm: error: --tp-degree 3 does not divide the world size 2"], proc.stderr[-4000:]


# --------------------------------------------------------------------- README demo


def test_readme_demo_under_torchrun(tmp_path):
    """README command (a) with a short run: torchrun, 2 ranks, the built-in corpus (built here, ~8 s).

    ``--standalone`` gives torchrun a local rendezvous on a port the OS picks, so no
    fixed port can collide with another job. ``python -m torch.distributed.run`` is the
    ``torchrun`` console script for this very interpreter.
    """
    save_dir = tmp_path / "checkpoints"
    command = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
        "-m", "distlm.train",
        "--max-update", "4", "--log-interval", "2", "--save-dir", str(save_dir),
        "--tokens-per-sample", "64", "--batch-size", "4",
    ]
    proc = subprocess.run(
        command, cwd=tmp_path, capture_output=True, text=True, timeout=SUBPROCESS_TIMEOUT,
        env=subprocess_env(DISTLM_CACHE_DIR=str(tmp_path / "cache")),
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "Traceback" not in proc.stderr, proc.stderr[-4000:]

    records = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    train = [r for r in records if r["kind"] == "train"]
    summary = [r for r in records if r["kind"] == "summary"]
    # Rank 0 alone prints: a line at the first update and one per --log-interval, then one summary.
    assert [r["update"] for r in train] == [1, 2, 4], proc.stdout
    assert len(summary) == 1, proc.stdout
    for record in train + summary:
        assert math.isfinite(record["loss"]) and record["loss"] > 0, record
        assert record["bsz"] == 8.0, record  # 2 ranks x --batch-size 4
    assert summary[0]["update"] == 4
    assert summary[0]["consumed_samples"] == 4 * 8

    state = last_checkpoint(save_dir)
    assert state["num_updates"] == 4
    assert state["consumed_samples"] == 32
    assert state["world_size"] == 2
    assert state["arch"] == "roberta_tiny"
    assert all(torch.isfinite(t).all() for t in state["model"].values())
    # The corpus was built where DISTLM_CACHE_DIR points, not in the user's cache.
    built = [d for d in (tmp_path / "cache").iterdir() if d.is_dir()]
    assert len(built) == 1 and built[0].name.startswith("stdlib-corpus-"), built
    assert (built[0] / "train.bin").is_file()


# ---------------------------------------- one 2-rank job, shared by five tests

TWO_RANK_UPDATES = 4
CHECKED_PARAMETER = "layers.2.fc1.weight"
# LayerNorm biases start at zero: +0.5 and -0.5 in two places leave a sum of exactly 0.
CANCELLING_PARAMETER = "layers.0.final_layer_norm.bias"
SWAPPED_PARAMETER = "layers.1.fc2.weight"


def train_and_check_replicas(args: list[str]) -> dict:
    """On each of 2 ranks: ``--check-replicas`` training, then perturbations made on rank 1 only.

    Returns what ``check_replicas()`` reported at each stage (None: it passed). Each
    perturbation made before training is undone exactly, so the saved checkpoint is
    that of a plain 4-update run.
    """
    trainer = Trainer(parse_args(args))
    params = dict(unwrap(trainer.model).named_parameters())
    rank = dist.get_rank()

    def check() -> str | None:
        try:
            trainer.check_replicas()
        except RuntimeError as exc:
            return str(exc)
        return None

    results = {"initial": check()}
    with torch.no_grad():
        bias = params[CANCELLING_PARAMETER]
        assert not bias.any()
        if rank == 1:
            bias[0] += 0.5
            bias[1] -= 0.5
        results["cancelling"] = check()
        bias.zero_()
    # Each update runs the check inside train_step (the flag is on); fit() must pass.
    results["fit"] = trainer.fit()
    results["after_fit"] = check()
    with torch.no_grad():
        weight = params[SWAPPED_PARAMETER]
        assert weight[0, 0] != weight[0, 1]
        original = weight[0, :2].clone()
        if rank == 1:
            weight[0, :2] = original.flip(0)
        results["swapped"] = check()
        weight[0, :2] = original
        results["restored"] = check()
        if rank == 1:
            params[CHECKED_PARAMETER][0, 0] += 1e-3
    results["perturbed"] = check()
    return results


@pytest.fixture(scope="module")
def two_rank_job(data_dir, tmp_path_factory) -> tuple[Path, list[dict]]:  # noqa: F811 - pytest fixture
    """4 updates on 2 torchrun-style ranks (the harness), 2 samples each, with --check-replicas.

    One job serves the explicit-launch test (its reference), the world-size resume test
    (its first half) and the three --check-replicas tests, because every 2-rank job costs
    several seconds of process start-up on this 2-core machine.
    """
    save_dir = tmp_path_factory.mktemp("two_rank")
    results = run_distributed(
        train_and_check_replicas, 2, args_for(data_dir, save_dir, TWO_RANK_UPDATES, 2, ["--check-replicas"])
    )
    return save_dir, results


def test_fairseq_explicit_launch_equals_torchrun_style(data_dir, two_rank_job, tmp_path):  # noqa: F811
    """Two ``python -m distlm.train`` processes started by hand, fairseq style, train the
    same model bit for bit as the harness's torchrun-style launch (same reduction order).

    Both runs use --check-replicas, so this also shows 2-rank runs with the flag passing.
    """
    # The one test that takes a port from binding port 0 and releasing it: another
    # process could grab it before rank 0 binds again. That small race is accepted
    # here because an explicit launch has rank 0 itself host the store at the address
    # given on the command line, so the port must be known before any process starts.
    port = find_free_port("127.0.0.1")
    save_dir = tmp_path / "explicit"
    base = args_for(data_dir, save_dir, TWO_RANK_UPDATES, 2, ["--check-replicas"])
    procs = []
    try:
        for rank in range(2):
            command = [
                sys.executable, "-m", "distlm.train", *base,
                "--distributed-world-size", "2", "--distributed-rank", str(rank),
                "--distributed-init-method", f"tcp://127.0.0.1:{port}",
            ]
            procs.append(subprocess.Popen(
                command, cwd=tmp_path, env=subprocess_env(), text=True,
                stdout=subprocess.PIPE, stderr=subprocess.PIPE,
            ))
        outputs = [proc.communicate(timeout=SUBPROCESS_TIMEOUT) for proc in procs]
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    for rank, (proc, (out, err)) in enumerate(zip(procs, outputs)):
        assert proc.returncode == 0, f"rank {rank}:\n{err[-4000:]}"
    # Only rank 0 prints the statistics.
    assert '"kind": "summary"' in outputs[0][0]
    # The flags say nothing of hosts; the hosts gathered at start do (one host here).
    assert "1 node found from the hosts" in outputs[0][1] and "node 0 of 1" in outputs[0][1], outputs[0][1][-4000:]
    assert outputs[1][0].strip() == ""

    reference_dir, _ = two_rank_job
    explicit, reference = last_checkpoint(save_dir), last_checkpoint(reference_dir)
    assert explicit["world_size"] == reference["world_size"] == 2
    assert explicit["num_updates"] == reference["num_updates"] == TWO_RANK_UPDATES
    assert explicit["consumed_samples"] == reference["consumed_samples"]
    assert_models_identical(explicit["model"], reference["model"])


def test_resume_on_a_different_world_size(data_dir, two_rank_job, tmp_path):  # noqa: F811
    """4 updates on 2 ranks x 2 samples, resumed on 1 rank x 4 samples for 4 more, equal
    8 straight updates on 1 rank x 4: the same global batches in the same order."""
    two_rank_dir, _ = two_rank_job
    resumed = tmp_path / "resumed"
    resumed.mkdir()
    shutil.copytree(two_rank_dir / checkpoint.LAST, resumed / checkpoint.LAST)
    fit(args_for(data_dir, resumed, 8, 4))
    fit(args_for(data_dir, tmp_path / "straight", 8, 4))
    after, reference = last_checkpoint(resumed), last_checkpoint(tmp_path / "straight")

    assert after["num_updates"] == reference["num_updates"] == 8
    assert after["consumed_samples"] == reference["consumed_samples"] == 8 * 4
    assert after["world_size"] == 1
    # Tolerance: the first 4 updates summed two half-batch gradients (DDP) where one
    # process reduces the whole batch inside its matmuls, so gradients differ by fp32
    # reassociation (~1e-7 relative). Adam divides each gradient by its own running
    # RMS, which amplifies that noise where a gradient is tiny (rare embedding rows), so
    # after 8 updates parameters differ by up to ~2e-7 (measured: 2.2e-7 in
    # embed_tokens, median over tensors 1.5e-8). 1e-5 leaves a 40x margin, while
    # resuming one global batch too late or too early (measured) gives a largest
    # difference of 1.4e-3 or 8e-4, and over 5e-4 in most tensors: 50x above it.
    assert after["model"].keys() == reference["model"].keys()
    for name, value in reference["model"].items():
        torch.testing.assert_close(after["model"][name], value, rtol=0, atol=1e-5, msg=lambda m: f"{name}: {m}")
    # The comparison has teeth: the 4 resumed updates moved parameters by ~1e-3 (measured).
    start = last_checkpoint(two_rank_dir)["model"]
    assert max(float((start[n] - value).abs().max()) for n, value in reference["model"].items()) > 1e-4


def test_check_replicas_passes_on_replicas_that_agree(two_rank_job):
    for rank, results in enumerate(two_rank_job[1]):
        assert results["initial"] is None, (rank, results)
        assert results["fit"]["update"] == TWO_RANK_UPDATES, (rank, results)
        assert results["after_fit"] is None, (rank, results)
        assert results["restored"] is None, (rank, results)


def test_check_replicas_names_the_differing_parameter_on_every_rank(two_rank_job):
    for rank, results in enumerate(two_rank_job[1]):
        message = results["perturbed"]
        assert message is not None, f"rank {rank} did not notice rank 1's changed {CHECKED_PARAMETER}"
        assert CHECKED_PARAMETER in message, message
        assert "ranks 0 and 1" in message, message


def test_check_replicas_catches_differences_a_float_sum_would_miss(two_rank_job):
    """+0.5/-0.5 in one tensor leaves its sum unchanged; so does swapping two elements."""
    for rank, results in enumerate(two_rank_job[1]):
        for stage, name in (("cancelling", CANCELLING_PARAMETER), ("swapped", SWAPPED_PARAMETER)):
            message = results[stage]
            assert message is not None, f"rank {rank} did not notice rank 1's {stage} {name}"
            assert name in message and "ranks 0 and 1" in message, message


# -------------------------------------------------------------- --num-workers


def test_num_workers_do_not_change_training(data_dir, tmp_path):  # noqa: F811
    """Batches prepared by 2 loader processes train bit-identically to in-process loading
    (masking is drawn from (seed, epoch, index), never from a worker's RNG)."""
    fit(args_for(data_dir, tmp_path / "inline", 3, 4, ["--num-workers", "0"]))
    fit(args_for(data_dir, tmp_path / "workers", 3, 4, ["--num-workers", "2"]))
    inline, workers = last_checkpoint(tmp_path / "inline"), last_checkpoint(tmp_path / "workers")
    assert inline["num_updates"] == workers["num_updates"] == 3
    assert inline["consumed_samples"] == workers["consumed_samples"]
    assert_models_identical(workers["model"], inline["model"])


# -------------------------------------------------------------- one visible device


TORCHRUN_WORKER = {"TORCHELASTIC_RUN_ID": "x", "CUDA_VISIBLE_DEVICES": "0"}


@pytest.mark.parametrize("environ, parent, refused", [
    # CUDA_VISIBLE_DEVICES=0 torchrun --nproc-per-node 8: every worker inherits the one GPU.
    (TORCHRUN_WORKER, {"CUDA_VISIBLE_DEVICES": "0"}, True),
    ({"TORCHELASTIC_RUN_ID": "x"}, {}, True),  # a node with one GPU and no variable at all
    # torchrun --no-python with a wrapper setting CUDA_VISIBLE_DEVICES=$LOCAL_RANK per worker.
    ({**TORCHRUN_WORKER, "CUDA_VISIBLE_DEVICES": "3"}, {"CUDA_VISIBLE_DEVICES": "0,1,2,3,4,5,6,7"}, False),
    # srun --gpus-per-task=1: every task is its own process, shown its own GPU.
    ({"SLURM_PROCID": "3", "CUDA_VISIBLE_DEVICES": "0"}, {"CUDA_VISIBLE_DEVICES": "0"}, False),
    (TORCHRUN_WORKER, None, False),  # the parent's environment unknown (not Linux): nothing to tell by
])
def test_one_visible_device_is_refused_when_torchrun_workers_would_share_it(environ, parent, refused, monkeypatch):
    if parent is None:
        monkeypatch.setattr(env_module, "_parent_environment", lambda: None)
    if not refused:
        assert device_index(3, 8, 1, environ=environ, parent_environ=parent) == 0
        return
    with pytest.raises(UsageError) as refusal:
        device_index(3, 8, 1, environ=environ, parent_environ=parent)
    setting = f"CUDA_VISIBLE_DEVICES={environ.get('CUDA_VISIBLE_DEVICES', 'unset')}"
    assert str(refusal.value) == (
        f"8 torchrun workers on this node would share one device: each inherits torchrun's {setting}, which "
        "shows one; make 8 devices visible to torchrun, or start one worker per node (--nproc-per-node 1)")


def test_a_worker_tells_an_inherited_device_from_its_own_by_its_parent(tmp_path):
    """Through /proc: an "agent" process started with CUDA_VISIBLE_DEVICES=0 starts a worker
    that inherits it (refused), and one that is given its own value (accepted)."""
    worker = ("import sys; from distlm.launch.devices import device_index; from distlm.errors import UsageError\n"
              "try: print(device_index(1, 2, 1))\nexcept UsageError as err: print(err)")
    agent = ("import os, subprocess, sys\n"
             "for own in (None, '1'):\n"
             "    env = dict(os.environ, **({} if own is None else {'CUDA_VISIBLE_DEVICES': own}))\n"
             f"    subprocess.run([sys.executable, '-c', {worker!r}], env=env, check=True)")
    out = subprocess.run([sys.executable, "-c", agent], env=subprocess_env(TORCHELASTIC_RUN_ID="x",
                         CUDA_VISIBLE_DEVICES="0"), capture_output=True, text=True, timeout=SUBPROCESS_TIMEOUT)
    assert out.returncode == 0, out.stderr
    inherited, own = out.stdout.strip().splitlines()
    assert inherited.startswith("2 torchrun workers on this node would share one device"), out.stdout
    assert own == "0"
