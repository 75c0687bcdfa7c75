"""Sharded checkpoints (distlm.checkpoint): exact resume, resharding, kill and restart,
memory per rank, async saves, retention, cadence, the old single-file format, errors.

Every reference is computed here: an uninterrupted run for exact resume and restarts,
the tensors the offline reader finds in the saved checkpoint for resharding, rank 1's
own peak for rank 0's memory, fairseq's save rule for retention. Spawned jobs are few
and each does many things, since starting processes costs seconds on a 2-core machine:
one 4-rank job, one 2-rank job, one 2-rank memory job and one torchrun job whose
workers are killed twice.
"""

from __future__ import annotations

import ctypes
import errno
import gc
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import textwrap
import types
from pathlib import Path

import numpy as np
import pytest
import torch

from distributed import run_distributed
from distlm import checkpoint
from distlm.export import cli as export
from distlm.checkpoint import Checkpointer, CheckpointReader
from distlm.checkpoint.directory import commit, incomplete, recover
from distlm.checkpoint.lock import GUARD_FILE
from distlm.config import parse_args
from distlm.data.indexed_dataset import write_indexed_dataset
from distlm.errors import UsageError
from distlm.state.full import consolidated_parameters
from distlm.observe.run_record import RUN_JSON
from distlm.train import main
from distlm.training.trainer import Trainer

HALF = 3  # updates before the stop; the straight run does 2 * HALF
BATCH = 4  # per replica; every layout here trains on a global batch of 8
ARCH = "llama_tiny"  # tensor parallel splits its embedding and output: every kind of shard
SUBPROCESS_TIMEOUT = 240



def saved_names(save_dir: Path) -> list[str]:
    """What a save dir holds besides what every run leaves there: the run record (run.json)
    and its lock's guard file (the lock itself is gone once a run ends)."""
    return sorted(p.name for p in save_dir.iterdir() if p.name not in (RUN_JSON, GUARD_FILE))


def train_args(data: str, save_dir: Path | str, max_update: int, layout: list[str] = (), batch: int = BATCH,
               interval: int = HALF, arch: str = ARCH) -> list[str]:
    """Dropout on, so exact resume needs every rank's RNG; the schedule's length fixed by
    --total-num-update, so a stopped run has the learning rates of the straight one."""
    return [
        "--data", data, "--arch", arch, "--tokens-per-sample", "32", "--batch-size", str(batch),
        "--dropout", "0.1", "--attention-dropout", "0.1", "--lr", "1e-3", "--warmup-updates", "2",
        "--total-num-update", str(2 * HALF), "--max-update", str(max_update), "--save-interval-updates", str(interval),
        "--log-interval", "1000", "--disable-validation", "--save-dir", str(save_dir), "--device", "cpu",
        "--seed", "4", *layout,
    ]


def fit(args: list[str], resumes_at: int | None = None) -> dict:
    """Train; the run must start fresh, or resume at update ``resumes_at`` (a run that
    ignored its checkpoint and started over with the same seed would write the same bits)."""
    trainer = Trainer(parse_args(args))
    assert trainer.resumed_at == resumes_at, f"started at update {trainer.resumed_at}, not {resumes_at}"
    return trainer.fit()


def straight_and_resumed(data: str, root: Path, layout: list[str], batch: int = BATCH) -> None:
    """2 * HALF updates straight into root/straight; HALF, a stop and HALF more into root/stopped."""
    fit(train_args(data, root / "straight", 2 * HALF, layout, batch))
    fit(train_args(data, root / "stopped", HALF, layout, batch))
    fit(train_args(data, root / "stopped", 2 * HALF, layout, batch), resumes_at=HALF)


def assert_same_checkpoint(actual: Path, expected: Path) -> None:
    """Bit for bit: every parameter, every Adam moment and step, and the training position."""
    a, b = checkpoint.load(actual), checkpoint.load(expected)
    assert (a["num_updates"], a["consumed_samples"]) == (b["num_updates"], b["consumed_samples"])
    assert a["model"].keys() == b["model"].keys()
    for name, value in b["model"].items():
        assert torch.equal(a["model"][name], value), f"{actual}: {name}"
    assert a["optimizer"]["state"].keys() == b["optimizer"]["state"].keys() == a["model"].keys()
    for name, entry in b["optimizer"]["state"].items():
        assert entry.keys() == a["optimizer"]["state"][name].keys() == {"step", "exp_avg", "exp_avg_sq"}
        for field, value in entry.items():
            assert torch.equal(a["optimizer"]["state"][name][field], value), f"{actual}: {name}.{field}"


def tree_digest(directory: Path) -> str:
    """The checkpoints' bytes; the run record (run.json) is rewritten by every run, by design."""
    digest = hashlib.sha256()
    for path in sorted(directory.rglob("*")):
        if path.is_file() and path.name != RUN_JSON:
            digest.update(str(path.relative_to(directory)).encode() + path.read_bytes())
    return digest.hexdigest()


class SaveSpy:
    """Records the names of every ``Checkpointer.save`` call and the update it saved."""

    def __init__(self, monkeypatch=None):
        self.calls: list[tuple[int, list[str]]] = []
        original = Checkpointer.save

        def save(checkpointer, names, states, *args, **kwargs):
            if names:
                self.calls.append((states["progress"].num_updates, list(names)))
            return original(checkpointer, names, states, *args, **kwargs)

        if monkeypatch is not None:
            monkeypatch.setattr(Checkpointer, "save", save)
        else:  # a spawned worker: patched for the rest of its life
            Checkpointer.save = save


# ------------------------------------------------------------- what a resumed rank holds


def samples_of(micro_batches: list[dict], pad: int) -> list[list[int]]:
    """Each sample's tokens, padding removed (micro-batches pad to their own longest sample)."""
    return [[t for t in row.tolist() if t != pad] for b in micro_batches for row in b["input_ids"]]


def loaded_state(args: list[str]) -> dict:
    """Build a Trainer that resumes (collective); return what it loaded, gathered whole.

    Parameters through ``consolidated_parameters`` (torch's state-dict API), Adam's state
    through each DTensor's ``full_tensor``: every rank returns the moments it holds
    (ZeRO-1: its partition), and the test merges them over ranks.
    """
    from torch.distributed.tensor import DTensor

    from distlm.checkpoint.stateful import optimizer_state

    trainer = Trainer(parse_args(args))
    moments = {}
    for name, entry in optimizer_state(trainer.model, trainer.optimizer).items():
        moments[name] = {field: (value.full_tensor() if isinstance(value, DTensor) else value).detach().clone()
                         for field, value in entry.items()}
    return {
        "params": consolidated_parameters(trainer.model),
        "moments": moments,
        "resumed_at": trainer.resumed_at,
        "consumed_samples": trainer.consumed_samples,
        "next_samples": samples_of(next(iter(trainer.update_batches())), trainer.data.dictionary.pad()),
        "dp_rank": trainer.ctx.dp_rank,
    }


def assert_loaded_equals_saved(ranks: list[dict], saved: Path) -> None:
    """Parameters and Adam moments after the load are the saved ones, exactly."""
    reader = CheckpointReader(saved)
    names = reader.model_names()
    for result in ranks:
        assert result["params"].keys() == set(names)
        for name in names:
            assert torch.equal(result["params"][name], reader.tensor(f"model.{name}")), name
    merged: dict = {}
    for result in ranks:
        for name, entry in result["moments"].items():
            for field, value in entry.items():
                if (name, field) in merged:
                    assert torch.equal(merged[name, field], value), (name, field)  # copies agree
                merged[name, field] = value
    saved_moments = {(name, field): value for name, entry in reader.optimizer_state().items()
                     for field, value in entry.items()}
    assert merged.keys() == saved_moments.keys() and len(saved_moments) == 3 * len(names)
    for key, value in saved_moments.items():
        assert torch.equal(merged[key], value), key


def next_global_batch(ranks: list[dict]) -> list[list[int]]:
    """The next update's global batch: each replica's samples, in dp order."""
    by_replica = {}
    for result in ranks:
        by_replica.setdefault(result["dp_rank"], result["next_samples"])
    return [sample for replica in sorted(by_replica) for sample in by_replica[replica]]


def fresh_global_batch(data: str, tmp_path: Path, update: int) -> list[list[int]]:
    """The global batch of 1-based ``update`` in one process from the start: where the data must continue."""
    trainer = Trainer(parse_args(train_args(data, tmp_path / "fresh", 2 * HALF, ["--no-save"], 2 * BATCH)))
    batches = trainer.update_batches()
    for _ in range(update - 1):
        next(batches)
    return samples_of(next(batches), trainer.data.dictionary.pad())


# ---------------------------------------------------------------------- 4 ranks


def _four_rank_job(data: str, root: str) -> None:
    straight_and_resumed(data, Path(root) / "zero1-tp2", ["--strategy", "zero1", "--tp-degree", "2"])
    fit(train_args(data, Path(root) / "fsdp-tp2", 1, ["--strategy", "fsdp", "--tp-degree", "2"], interval=0))


@pytest.fixture(scope="module")
def four_rank_runs(data_dir, tmp_path_factory) -> Path:  # noqa: F811 - pytest fixture
    root = tmp_path_factory.mktemp("four")
    run_distributed(_four_rank_job, 4, data_dir, str(root), timeout=300)
    return root


# ---------------------------------------------------------------------- 2 ranks

TWO_RANK_LAYOUTS = {
    "fsdp": (["--strategy", "fsdp"], BATCH),
    "zero1": (["--strategy", "zero1"], BATCH),
    "ddp-tp2": (["--strategy", "ddp", "--tp-degree", "2"], 2 * BATCH),
}


def _two_rank_job(data: str, root: str, zero1_tp2_checkpoint: str) -> dict:
    root = Path(root)
    spy = SaveSpy()
    out = {}
    for case, (layout, batch) in TWO_RANK_LAYOUTS.items():
        straight_and_resumed(data, root / case, layout, batch)
    # Asynchronous saves write what the synchronous ones do, though training went on meanwhile.
    fit(train_args(data, root / "fsdp-async", 2 * HALF, ["--strategy", "fsdp", "--async-save"]))
    # The uninterrupted reference of the torchrun restarts.
    fit(train_args(data, root / "ddp-every-2", 2 * HALF, interval=2))
    # Resharding: a checkpoint of fsdp x 2 read by tp 2, one of zero1 x tp2 on 4 ranks by fsdp x 2.
    fsdp_saved = root / "fsdp" / "straight" / checkpoint.numbered(HALF)
    out["fsdp->ddp-tp2"] = loaded_state(train_args(
        data, root / "fsdp-to-ddp-tp2", 2 * HALF, ["--tp-degree", "2", "--restore-file", str(fsdp_saved)], 2 * BATCH))
    out["zero1-tp2->fsdp"] = loaded_state(train_args(
        data, root / "zero1-tp2-to-fsdp", 2 * HALF, ["--strategy", "fsdp", "--restore-file", zero1_tp2_checkpoint]))
    # The old single-file format, read into fsdp's shards.
    _write_single_file_copy(root / "fsdp" / "straight" / checkpoint.numbered(HALF), root / "fsdp-from-single-file")
    fit(train_args(data, root / "fsdp-from-single-file", 2 * HALF, ["--strategy", "fsdp"]), resumes_at=HALF)
    # Cadence: the first update of double buffering applies nothing, so saves nothing.
    spy.calls.clear()
    fit(train_args(data, root / "double-buffering", 2, ["--double-buffering"], interval=1, arch="roberta_tiny"))
    out["double_buffering_saves"] = list(spy.calls)
    out["disk_full"] = _fill_the_disk_on_rank_1(data, root / "disk-full")
    out["flipped"] = _resume_after_a_flipped_byte(data, root / "fsdp" / "straight", root / "flipped")
    return out


def _resume_after_a_flipped_byte(data: str, source: Path, save_dir: Path) -> str:
    """A copy of an fsdp save dir with one byte of rank 1's shard of checkpoint_last flipped."""
    import torch.distributed as dist

    if dist.get_rank() == 0:
        shutil.copytree(source, save_dir)
        shard = save_dir / checkpoint.LAST / "__1_0.distcp"
        data_bytes = bytearray(shard.read_bytes())
        data_bytes[len(data_bytes) // 2] ^= 0x10
        shard.write_bytes(data_bytes)
    dist.barrier()
    try:
        Trainer(parse_args(train_args(data, save_dir, 2 * HALF + 1, ["--strategy", "fsdp"])))
    except UsageError as err:
        return str(err)
    return "resumed"


def _write_single_file_copy(source: Path, save_dir: Path) -> None:
    """``save_dir/checkpoint_last.pt``: ``source`` in the previous release's single-file format
    (every tensor whole under its single-device name, every rank's RNG state in rank order)."""
    import torch.distributed as dist

    if dist.get_rank() == 0:
        reader = CheckpointReader(source)
        meta = reader.meta
        save_dir.mkdir()
        torch.save({
            "format": 1, "arch": meta["arch"], "task": meta["task"], "config": meta["config"],
            "model": dict(reader.model_tensors()), "optimizer": {"state": reader.optimizer_state()},
            "scaler": None, "rng": [{"cpu": reader.tensor(f"rng.rank{r}.cpu")} for r in range(meta["world_size"])],
            "world_size": meta["world_size"], "layout": meta["layout"], "dictionary": meta["dictionary"],
            "num_updates": meta["progress"]["num_updates"], "consumed_samples": meta["progress"]["consumed_samples"],
        }, save_dir / "checkpoint_last.pt")
    dist.barrier()


def _fill_the_disk_on_rank_1(data: str, save_dir: Path) -> str:
    """The second save meets ENOSPC on rank 1 only, after rank 1 wrote part of its file: a
    shared file system that fills up under one writer. Simulated by making torch's file
    writer raise what write(2) raises on a full disk (a real full disk: the tmpfs test)."""
    import torch.distributed as dist
    import torch.distributed.checkpoint.filesystem as dcp_files

    original, written = dcp_files._write_item, []

    def write_item(transforms, stream, data, write_item, *args):
        if dist.get_rank() == 1 and incomplete(save_dir, checkpoint.numbered(2)).name in stream.name:
            written.append(write_item)
            if len(written) == 2:
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return original(transforms, stream, data, write_item, *args)

    dcp_files._write_item = write_item
    try:
        fit(train_args(data, save_dir, 3, interval=1, arch="roberta_tiny"))
    except UsageError as err:
        return str(err)
    finally:
        dcp_files._write_item = original
    return "no error"


@pytest.fixture(scope="module")
def two_rank_runs(data_dir, tmp_path_factory, four_rank_runs) -> tuple[Path, list[dict]]:  # noqa: F811
    root = tmp_path_factory.mktemp("two")
    saved = four_rank_runs / "zero1-tp2" / "straight" / checkpoint.numbered(HALF)
    results = run_distributed(_two_rank_job, 2, data_dir, str(root), str(saved), timeout=400)
    return root, results


@pytest.mark.parametrize("case", [*TWO_RANK_LAYOUTS, "zero1-tp2"])
def test_resume_is_exact(case, two_rank_runs, four_rank_runs):
    """HALF updates, a stop, a resume and HALF more equal 2 * HALF straight, bit for bit
    (CPU fp32, dropout on; ddp is test_resume.py's)."""
    root = (four_rank_runs if case == "zero1-tp2" else two_rank_runs[0]) / case
    assert checkpoint.load(root / "stopped" / checkpoint.LAST)["num_updates"] == 2 * HALF
    assert_same_checkpoint(root / "stopped" / checkpoint.LAST, root / "straight" / checkpoint.LAST)
    # The checkpoint the resume started from is the straight run's at the same update.
    assert_same_checkpoint(root / "stopped" / checkpoint.numbered(HALF), root / "straight" / checkpoint.numbered(HALF))


def test_a_single_file_checkpoint_resumes_into_fsdp_shards_exactly(two_rank_runs):
    root = two_rank_runs[0]
    assert_same_checkpoint(root / "fsdp-from-single-file" / checkpoint.LAST, root / "fsdp" / "straight" / checkpoint.LAST)


def test_async_save_writes_what_a_synchronous_save_writes(two_rank_runs):
    """Staged at the save, so the updates that run while it is written do not leak into it."""
    root = two_rank_runs[0]
    for name in (checkpoint.numbered(HALF), checkpoint.LAST):
        assert_same_checkpoint(root / "fsdp-async" / name, root / "fsdp" / "straight" / name)
    assert not list((root / "fsdp-async").glob(".incomplete-*"))


def test_zero1_tp2_on_4_ranks_resumes_under_fsdp_on_2_and_in_one_process(data_dir, tmp_path, two_rank_runs,
                                                                         four_rank_runs):
    saved = four_rank_runs / "zero1-tp2" / "straight" / checkpoint.numbered(HALF)
    expected_batch = fresh_global_batch(data_dir, tmp_path, HALF + 1)
    one = [loaded_state(train_args(data_dir, tmp_path / "one", 2 * HALF, ["--restore-file", str(saved)], 2 * BATCH))]
    for ranks in ([r["zero1-tp2->fsdp"] for r in two_rank_runs[1]], one):
        assert all(r["resumed_at"] == HALF and r["consumed_samples"] == HALF * 2 * BATCH for r in ranks)
        assert_loaded_equals_saved(ranks, saved)
        assert next_global_batch(ranks) == expected_batch


def test_fsdp_on_2_ranks_resumes_under_ddp_tp2(data_dir, tmp_path, two_rank_runs):
    root, results = two_rank_runs
    saved = root / "fsdp" / "straight" / checkpoint.numbered(HALF)
    ranks = [r["fsdp->ddp-tp2"] for r in results]
    assert all(r["resumed_at"] == HALF and r["consumed_samples"] == HALF * 2 * BATCH for r in ranks)
    assert_loaded_equals_saved(ranks, saved)
    assert next_global_batch(ranks) == fresh_global_batch(data_dir, tmp_path, HALF + 1)


def test_every_layout_writes_the_keys_of_one_process(data_dir, tmp_path, two_rank_runs, four_rank_runs):
    """The same keys, shapes and dtypes whoever wrote them: fsdp, zero1 and tp on 2 ranks,
    zero1 x tp2 and fsdp x tp2 on 4."""
    fit(train_args(data_dir, tmp_path, 1, batch=2 * BATCH, interval=0))

    def layout_of(path: Path) -> dict:
        reader = CheckpointReader(path)
        return {key: reader.tensor_spec(key) for key in reader.keys() if not key.startswith("rng.")}

    expected = layout_of(tmp_path / checkpoint.LAST)
    written = [two_rank_runs[0] / case / "straight" / checkpoint.LAST for case in TWO_RANK_LAYOUTS]
    for path in [*written, four_rank_runs / "zero1-tp2" / "straight" / checkpoint.LAST,
                 four_rank_runs / "fsdp-tp2" / checkpoint.LAST]:
        assert layout_of(path) == expected, path


def test_export_reads_only_the_weights_of_a_sharded_checkpoint(two_rank_runs, tmp_path, monkeypatch):
    """A save dir written by 2 fsdp ranks, exported in this process (no process group)."""
    from safetensors.torch import load_file

    save_dir = two_rank_runs[0] / "fsdp" / "straight"
    read = []
    original = CheckpointReader.tensors
    monkeypatch.setattr(CheckpointReader, "tensors", lambda self, keys: read.extend(keys) or original(self, keys))
    out = tmp_path / "model.safetensors"
    export.export(str(save_dir), str(out))
    assert read and all(key.startswith("model.") for key in read)
    expected = checkpoint.load(save_dir / checkpoint.LAST)["model"]
    weights = load_file(str(out))
    assert weights.keys() == expected.keys()
    assert all(torch.equal(weights[name], value) for name, value in expected.items())


def test_cadence_saves_nothing_after_an_update_that_applied_nothing(two_rank_runs):
    """Double buffering's first update applies nothing: no checkpoint_0, and each update once."""
    for saves in (r["double_buffering_saves"] for r in two_rank_runs[1]):
        assert [update for update, _ in saves] == [1, 2], saves
        assert saves[0][1] == [checkpoint.numbered(1), checkpoint.LAST]
    assert not (two_rank_runs[0] / "double-buffering" / checkpoint.numbered(0)).exists()


def test_a_disk_that_fills_on_one_rank_ends_the_run_and_keeps_the_previous_checkpoint(two_rank_runs):
    root, results = two_rank_runs
    save_dir = root / "disk-full"
    for message in (r["disk_full"] for r in results):
        assert message == (f"saving {checkpoint.numbered(2)}, {checkpoint.LAST} in {save_dir} failed: "
                           f"{os.strerror(errno.ENOSPC)}; the previous checkpoint is intact")
    assert checkpoint.load(save_dir / checkpoint.LAST)["num_updates"] == 1
    assert checkpoint.load(save_dir / checkpoint.numbered(1))["num_updates"] == 1
    assert not (save_dir / checkpoint.numbered(2)).exists()
    assert not list(save_dir.glob(".incomplete-*"))  # removed at once, not left to the next start


def test_a_flipped_byte_is_refused_on_two_ranks_and_at_export(two_rank_runs, tmp_path, capsys):
    root, results = two_rank_runs
    shard = root / "flipped" / checkpoint.LAST / "__1_0.distcp"
    for message in (r["flipped"] for r in results):
        assert str(shard) in message and f"--restore-file {checkpoint.numbered(HALF)}" in message, message
    assert export.main(["--checkpoint", str(root / "flipped"), "--out", str(tmp_path / "out.safetensors")]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and str(shard) in lines[0], lines


# ----------------------------------------------------------- memory of each rank

# llama_tiny widened to 21M parameters: dim 512, 5 layers, SwiGLU inner size 2048.
WIDE_LLAMA = ["--decoder-embed-dim", "512", "--decoder-layers", "5", "--decoder-ffn-embed-dim", "2048",
              "--decoder-attention-heads", "8", "--kv-heads", "8"]


class PeakResidentBytes:
    """The peak of this process's resident memory inside the block, above what it held at the start.

    CPU tensors come from torch's C++ allocator and DCP reads file slices into Python
    bytes: tracemalloc sees neither, but the kernel counts every resident page whoever
    allocated it. Writing 5 to /proc/self/clear_refs resets the kernel's own high-water
    mark (VmHWM), so the peak is exact, where sampling RSS from a thread could miss a
    short one. malloc_trim first returns freed heap pages, so memory freed before the
    block (rank 0's whole-model initialisation) cannot hide allocations inside it.
    """

    def __enter__(self) -> PeakResidentBytes:
        gc.collect()
        ctypes.CDLL("libc.so.6").malloc_trim(0)
        Path("/proc/self/clear_refs").write_text("5")
        self.start = self._status("VmRSS")
        return self

    def __exit__(self, *exc_info) -> None:
        self.bytes = self._status("VmHWM") - self.start

    @staticmethod
    def _status(field: str) -> int:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
        raise AssertionError(f"/proc/self/status has no {field}")


def _memory_job(data: str, save_dir: str) -> dict:
    from distlm.training.memory import memory_report

    args = train_args(data, save_dir, 1, ["--strategy", "fsdp", *WIDE_LLAMA], batch=1, interval=0)
    trainer = Trainer(parse_args(args))
    trainer.train_step(next(trainer.update_batches()))  # Adam's moments exist; gradients are freed
    held = memory_report(trainer.model, trainer.optimizer)
    with PeakResidentBytes() as saving:
        trainer.save_checkpoint()
    loading = {}
    original = Checkpointer.load

    def measured_load(*args, **kwargs):
        with PeakResidentBytes() as peak:
            progress = original(*args, **kwargs)
        loading["bytes"] = peak.bytes
        return progress

    Checkpointer.load = measured_load
    resumed = Trainer(parse_args(args))
    assert resumed.resumed_at == 1
    return {"params": held["param_bytes"], "optimizer": held["optimizer_bytes"],
            "save": saving.bytes, "load": loading["bytes"]}


def test_no_rank_gathers_the_model_to_save_or_load(data_dir, tmp_path):  # noqa: F811
    """fsdp on 2 ranks, 21M parameters: while saving or loading, each rank holds its own
    shards plus about one tensor, rank 0 (DCP's coordinator) included."""
    ranks = run_distributed(_memory_job, 2, data_dir, str(tmp_path), timeout=300)
    reader = CheckpointReader(tmp_path / checkpoint.LAST)
    sizes = [int(np.prod(reader.tensor_spec(f"model.{name}")[0])) for name in reader.model_names()]
    assert sum(sizes) >= 20_000_000
    largest = 4 * max(sizes)  # bytes of the largest whole fp32 tensor (a feed-forward matrix, 4 MiB)
    print(json.dumps({"parameters": sum(sizes), "largest_tensor_bytes": largest, "per_rank": ranks}))
    # The peak a rank reaches: the state it holds (its shards of the weights, and of Adam's
    # moments once they exist) plus what saving or loading allocates on top. A resumed
    # model's shards are allocated but never written before the load (nothing initialises
    # them), so the kernel counts their pages inside the load: its peak holds the weights too.
    peak = [{"save": r["params"] + r["optimizer"] + r["save"], "load": r["load"]} for r in ranks]
    for phase in ("save", "load"):
        assert peak[0][phase] <= 1.5 * peak[1][phase], (phase, ranks)
    for result in ranks:
        # The old single-file save gathered the whole model (84 MB) and both moments on rank 0.
        assert result["save"] < 2 * largest, ranks
        # Loading fills the rank's shards, allocates its own Adam moments and reads each
        # tensor's slices into them.
        assert result["load"] < result["params"] + result["optimizer"] + 4 * largest, ranks


# ------------------------------------------------- torchrun restarts after SIGKILL

# A torchrun worker that kills itself twice: rank 1 of the first attempt right after
# checkpoint_2 is committed, rank 1 of the second inside the write of checkpoint_4
# (its own shard written, the checkpoint's metadata not). Each note says what it saw.
RESTART_WORKER = textwrap.dedent('''
    import json, os, signal, sys
    from pathlib import Path

    import torch.distributed.checkpoint.filesystem as dcp_files
    from distlm.checkpoint.saving import CheckpointSaver
    from distlm.train import run

    attempt, rank = int(os.environ["TORCHELASTIC_RESTART_COUNT"]), int(os.environ["RANK"])
    notes = Path(os.environ["KILL_NOTES"])

    def die(note):
        (notes / f"attempt{attempt}").write_text(note)
        os.kill(os.getpid(), signal.SIGKILL)

    commit = CheckpointSaver._commit
    def commit_then_die(self, names, meta, *hashed):
        commit(self, names, meta, *hashed)
        if attempt == 0 and rank == 1 and "checkpoint_2" in names:
            die(json.dumps(sorted(os.listdir(self.save_dir))))
    CheckpointSaver._commit = commit_then_die

    write_data = dcp_files._FileSystemWriter.write_data
    def write_then_die(self, plan, planner):
        written = write_data(self, plan, planner)
        if attempt == 1 and rank == 1 and Path(self.path).name == ".incomplete-checkpoint_4":
            written.wait()
            die(json.dumps(sorted(os.listdir(self.path))))
        return written
    dcp_files._FileSystemWriter.write_data = write_then_die
    run()
''')


def test_killed_workers_restart_under_torchrun_and_finish_bit_identical(data_dir, tmp_path, two_rank_runs):  # noqa: F811
    save_dir, notes = tmp_path / "checkpoints", tmp_path / "notes"
    notes.mkdir()
    command = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", "--max-restarts", "2",
        "--no-python", sys.executable, "-c", RESTART_WORKER, *train_args(data_dir, save_dir, 2 * HALF, interval=2),
    ]
    proc = subprocess.run(command, cwd=tmp_path, capture_output=True, text=True, timeout=SUBPROCESS_TIMEOUT,
                          env={**os.environ, "OMP_NUM_THREADS": "1", "KILL_NOTES": str(notes),
                               "PYTHONPATH": str(Path(__file__).resolve().parents[1])})
    assert proc.returncode == 0, proc.stderr[-4000:]
    # First kill: after the numbered save, both names committed.
    assert {checkpoint.numbered(2), checkpoint.LAST} <= set(json.loads((notes / "attempt0").read_text()))
    # Second kill: inside the next save, which had rank 1's shard and no metadata yet.
    partial = json.loads((notes / "attempt1").read_text())
    assert "__1_0.distcp" in partial and ".metadata" not in partial and "distlm.json" not in partial
    # The third attempt removed the partial directory and resumed from the previous checkpoint.
    assert "removed .incomplete-checkpoint_4, left by a save that did not finish" in proc.stderr
    assert len(re.findall(rf"resumed from {save_dir / checkpoint.LAST} at update 2 ", proc.stderr)) == 2
    assert not list(save_dir.glob(".incomplete-*"))
    reference = two_rank_runs[0] / "ddp-every-2"
    for name in (checkpoint.LAST, checkpoint.numbered(4)):
        assert_same_checkpoint(save_dir / name, reference / name)


# --------------------------------------------------------- retention and cadence

UPDATES_PER_EPOCH = 3


@pytest.fixture(scope="module")
def small_data(tmp_path_factory) -> str:
    """12 sentences, one sample each (--sample-break-mode eos): 3 updates of 4 per epoch."""
    root = tmp_path_factory.mktemp("small")
    rng = np.random.default_rng(1)
    (root / "dict.txt").write_text("".join(f"w{i} {100 - i}\n" for i in range(20)))
    sentences = [np.append(rng.integers(4, 24, size=rng.integers(8, 20)), 2) for _ in range(4 * UPDATES_PER_EPOCH)]
    write_indexed_dataset(str(root / "train"), sentences, np.uint16)
    return str(root)


def epoch_args(data: str, save_dir: Path, max_epoch: int, extra: list[str]) -> list[str]:
    return ["--data", data, "--arch", ARCH, "--sample-break-mode", "eos", "--tokens-per-sample", "32",
            "--batch-size", "4", "--max-epoch", str(max_epoch), "--log-interval", "1000", "--disable-validation",
            "--save-dir", str(save_dir), "--device", "cpu", "--seed", "1", *extra]


def fairseq_saves(epochs: int, save_interval_updates: int, save_interval: int, no_epoch_checkpoints: bool) -> list:
    """(update, names) of every save fairseq makes: train.py's validate_and_save decides when
    (end of a --save-interval-th epoch, every --save-interval-updates, at the stop) and
    checkpoint_utils.save_checkpoint's conditions decide the names (fairseq calls the
    numbered one checkpoint_<epoch>_<updates>; distlm and this issue checkpoint_<updates>)."""
    saves = []
    total = epochs * UPDATES_PER_EPOCH
    for update in range(1, total + 1):
        end_of_epoch, epoch = update % UPDATES_PER_EPOCH == 0, (update - 1) // UPDATES_PER_EPOCH + 1
        interval = save_interval_updates > 0 and update % save_interval_updates == 0
        if not ((end_of_epoch and epoch % save_interval == 0) or update == total or interval):
            continue
        names = {checkpoint.LAST}
        if end_of_epoch and not no_epoch_checkpoints and epoch % save_interval == 0:
            names.add(checkpoint.epoch_name(epoch))
        if not end_of_epoch and interval:
            names.add(checkpoint.numbered(update))
        saves.append((update, names))
    return saves


@pytest.mark.parametrize("no_epoch_checkpoints", [False, True])
def test_retention_and_save_interval_follow_fairseq(small_data, tmp_path, monkeypatch, no_epoch_checkpoints):
    spy = SaveSpy(monkeypatch)
    flags = ["--save-interval-updates", "2", "--save-interval", "2", "--keep-interval-updates", "2",
             "--keep-last-epochs", "1"] + (["--no-epoch-checkpoints"] if no_epoch_checkpoints else [])
    fit(epoch_args(small_data, tmp_path, 4, flags))
    expected = fairseq_saves(4, 2, 2, no_epoch_checkpoints)
    assert [(update, set(names)) for update, names in spy.calls] == expected
    written = {name for _, names in expected for name in names}
    numbered = sorted((n for n in written if n.startswith("checkpoint_") and n != checkpoint.LAST),
                      key=lambda n: int(n.split("_")[1]))
    epochs = sorted((n for n in written if re.fullmatch(r"checkpoint\d+", n)), key=lambda n: int(n[10:]))
    kept = {checkpoint.LAST, *numbered[-2:], *epochs[-1:]}
    assert set(saved_names(tmp_path)) == kept
    for name in kept:
        assert CheckpointReader(tmp_path / name).meta["progress"]["num_updates"] == max(
            update for update, names in expected if name in names)

    # Started again on its finished save dir, the run resumes at the end and writes nothing.
    before, spy.calls[:] = tree_digest(tmp_path), []
    fit(epoch_args(small_data, tmp_path, 4, flags), resumes_at=expected[-1][0])
    assert spy.calls == [] and tree_digest(tmp_path) == before


def test_skipped_fp16_updates_save_nothing(data_dir, tmp_path, monkeypatch, caplog):  # noqa: F811
    """A loss scale far too large overflows the first updates, which are skipped: with a save
    due every update, nothing is saved until an update is applied, and each update once."""
    spy = SaveSpy(monkeypatch)
    args = train_args(data_dir, tmp_path, 2, interval=1, arch="roberta_tiny")
    with caplog.at_level("INFO", logger="distlm"):
        fit(args + ["--fp16", "--allow-slow-fp16", "--fp16-init-scale", str(2.0**24)])
    # Skipped updates before the first save and after it, when update 1's count stays due.
    skipped = [r.getMessage() for r in caplog.records if r.getMessage().endswith("update skipped")]
    assert any(m.startswith("update 1:") for m in skipped) and any(m.startswith("update 2:") for m in skipped)
    assert [update for update, _ in spy.calls] == [1, 2]
    assert not (tmp_path / checkpoint.numbered(0)).exists()
    assert saved_names(tmp_path) == [checkpoint.numbered(1), checkpoint.numbered(2), checkpoint.LAST]


def test_the_fp16_loss_scaler_continues_across_a_resume(data_dir, tmp_path):  # noqa: F811
    """A scale too large for the first updates and a window of 2: the scale falls, then
    grows, and --fp16-max-skips counts overflows in a row. Stopped after 2 updates and
    resumed, the run ends where the straight one does, scaler state and weights alike."""
    fp16 = ["--fp16", "--allow-slow-fp16", "--fp16-init-scale", str(2.0**20), "--fp16-scale-window", "2",
            "--fp16-max-skips", "40"]
    fit(train_args(data_dir, tmp_path / "straight", 4, interval=2, arch="roberta_tiny") + fp16)
    fit(train_args(data_dir, tmp_path / "stopped", 2, interval=2, arch="roberta_tiny") + fp16)
    fit(train_args(data_dir, tmp_path / "stopped", 4, interval=2, arch="roberta_tiny") + fp16, resumes_at=2)
    saved = [CheckpointReader(tmp_path / run / checkpoint.LAST).meta["scaler"] for run in ("straight", "stopped")]
    assert saved[0] == saved[1] and set(saved[0]) == {"scale", "clean_updates", "consecutive_skips"}
    assert saved[0]["scale"] != 2.0**20  # the scaler did change on the way
    assert_same_checkpoint(tmp_path / "stopped" / checkpoint.LAST, tmp_path / "straight" / checkpoint.LAST)


# ------------------------------------------------------------- the old format


def test_a_checkpoint_of_the_single_file_format_resumes_exactly(data_dir, tmp_path):  # noqa: F811
    """A checkpoint_last.pt as the previous release wrote it (whole state gathered by torch's
    state-dict API, every rank's RNG in a list) resumes bit for bit, and the next save
    writes the sharded format."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

    from distlm.checkpoint.stateful import capture_rng
    from distlm.state.full import full_state_dict

    single = ["--batch-size", str(2 * BATCH)]
    fit(train_args(data_dir, tmp_path / "straight", 2 * HALF) + single)

    stopped = tmp_path / "stopped"
    trainer = Trainer(parse_args(train_args(data_dir, stopped, HALF) + single + ["--no-save"]))
    batches = trainer.update_batches()
    for _ in range(HALF):
        trainer.train_step(next(batches))
    stopped.mkdir()
    torch.save({
        "format": 1, "arch": ARCH, "task": "causal_lm", "config": trainer.config.to_dict(),
        "model": full_state_dict(trainer.model),
        "optimizer": get_optimizer_state_dict(trainer.model, trainer.optimizer,
                                              options=StateDictOptions(full_state_dict=True, cpu_offload=True)),
        "scheduler": {"num_updates": trainer.num_updates}, "scaler": None, "rng": [capture_rng()],
        "world_size": 1, "layout": {"dp": 1, "tp": 1}, "num_updates": trainer.num_updates,
        "consumed_samples": trainer.consumed_samples, "dictionary": list(trainer.data.dictionary.symbols),
    }, stopped / "checkpoint_last.pt")

    fit(train_args(data_dir, stopped, 2 * HALF) + single, resumes_at=HALF)
    assert_same_checkpoint(stopped / checkpoint.LAST, tmp_path / "straight" / checkpoint.LAST)
    assert CheckpointReader(stopped).path == stopped / checkpoint.LAST  # the sharded one, preferred from now on


# ---------------------------------------------------------------- one-line errors


def run_main(argv: list[str], capsys) -> tuple[int, list[str]]:
    code = main(argv)
    return code, [line for line in capsys.readouterr().err.splitlines() if line.startswith("distlm: error:")]


@pytest.fixture
def never_trains(monkeypatch):
    """Errors about the save dir or the checkpoint must come before the first update."""
    def train_step(*args, **kwargs):
        raise AssertionError("training started")
    monkeypatch.setattr(Trainer, "train_step", train_step)


def copy_of(checkpoint_dir: Path, save_dir: Path) -> Path:
    save_dir.mkdir()
    shutil.copytree(checkpoint_dir, save_dir / checkpoint.LAST)
    return save_dir / checkpoint.LAST


def test_a_damaged_checkpoint_is_a_one_line_error(data_dir, tmp_path, two_rank_runs, capsys, never_trains):  # noqa: F811
    """Rank 1's shard missing, or either metadata file: one line naming what is missing, and
    the damaged checkpoint is neither trained over nor replaced."""
    written = two_rank_runs[0] / "fsdp" / "straight" / checkpoint.LAST
    for missing in ("__1_0.distcp", ".metadata", "distlm.json"):
        damaged = copy_of(written, tmp_path / missing)
        (damaged / missing).unlink()
        before = tree_digest(damaged)
        code, lines = run_main(train_args(data_dir, damaged.parent, 2 * HALF, batch=2 * BATCH), capsys)
        assert code == 2 and len(lines) == 1, lines
        assert str(damaged) in lines[0] and f"lacks {'shard ' if missing.endswith('distcp') else ''}{missing}" in lines[0]
        assert tree_digest(damaged) == before


def test_a_checkpoint_missing_a_nested_key_is_a_one_line_error(data_dir, tmp_path, two_rank_runs, capsys,  # noqa: F811
                                                                never_trains):
    """distlm.json edited by hand: resume and export both name the file and the key."""
    damaged = copy_of(two_rank_runs[0] / "fsdp" / "straight" / checkpoint.LAST, tmp_path / "save")
    meta = json.loads((damaged / "distlm.json").read_text())
    del meta["progress"]["num_updates"]
    (damaged / "distlm.json").write_text(json.dumps(meta))
    code, lines = run_main(train_args(data_dir, damaged.parent, 2 * HALF, batch=2 * BATCH), capsys)
    assert code == 2 and len(lines) == 1, lines
    assert f"{damaged / 'distlm.json'} holds no progress.num_updates" in lines[0]
    assert export.main(["--checkpoint", str(damaged), "--out", str(tmp_path / "out.safetensors")]) == 2
    message = capsys.readouterr().err.strip().splitlines()
    assert len(message) == 1 and "holds no progress.num_updates" in message[0], message


def test_a_checkpoint_of_another_dictionary_is_a_one_line_error(data_dir, tmp_path, two_rank_runs, capsys,  # noqa: F811
                                                                never_trains):
    other = tmp_path / "other-data"
    shutil.copytree(data_dir, other)
    symbols = (other / "dict.txt").read_text().splitlines()
    (other / "dict.txt").write_text("\n".join([symbols[1], symbols[0], *symbols[2:]]) + "\n")
    copy_of(two_rank_runs[0] / "fsdp" / "straight" / checkpoint.LAST, tmp_path / "save")
    code, lines = run_main(train_args(str(other), tmp_path / "save", 2 * HALF, batch=2 * BATCH), capsys)
    assert code == 2 and len(lines) == 1 and "dictionary differs" in lines[0], lines


@pytest.mark.parametrize("problem", ["a file", "below a file", "not writable"])
def test_an_unusable_save_dir_is_refused_before_training(problem, data_dir, tmp_path, capsys, never_trains):  # noqa: F811
    (tmp_path / "file").write_text("not a directory")
    # root ignores permission bits, so a chmod'ed directory would be writable here; /proc
    # refuses new files to everyone.
    save_dir = {"a file": tmp_path / "file", "below a file": tmp_path / "file" / "checkpoints",
                "not writable": Path("/proc/self")}[problem]
    code, lines = run_main(train_args(data_dir, save_dir, 1), capsys)
    assert code == 2 and len(lines) == 1 and lines[0].startswith(f"distlm: error: --save-dir {save_dir} "), lines
    assert {"a file": "is a file", "below a file": "cannot be created", "not writable": "is not writable"}[problem] in lines[0]


def test_a_full_disk_ends_the_run_with_one_line_and_keeps_the_previous_checkpoint(data_dir, tmp_path, capsys):  # noqa: F811
    """A real full disk: a tmpfs with room for one checkpoint and a half."""
    args = train_args(data_dir, tmp_path / "sizing", 1, interval=1, arch="roberta_tiny")
    fit(args)
    size = sum(p.stat().st_size for p in (tmp_path / "sizing" / checkpoint.LAST).rglob("*") if p.is_file())
    small = tmp_path / "small"
    small.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size * 3 // 2}", "tmpfs", str(small)],
                             capture_output=True, text=True)
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a small tmpfs here ({mounted.stderr.strip()}); "
                    "test_a_disk_that_fills_on_one_rank... simulates the full disk instead")
    try:
        code, lines = run_main(train_args(data_dir, small, 3, interval=1, arch="roberta_tiny"), capsys)
        assert code == 2 and len(lines) == 1, lines
        assert lines[0].startswith(f"distlm: error: saving {checkpoint.numbered(2)}, {checkpoint.LAST} in {small} "
                                   f"failed: {os.strerror(errno.ENOSPC)}"), lines
        assert lines[0].endswith("; the previous checkpoint is intact")
        assert checkpoint.load(small / checkpoint.LAST)["num_updates"] == 1
        assert saved_names(small) == [checkpoint.numbered(1), checkpoint.LAST]
    finally:
        subprocess.run(["umount", str(small)], check=True)


# ------------------------------------------------------- directories, no processes


def test_recover_puts_back_a_checkpoint_stepped_aside_and_removes_the_rest(tmp_path):
    """A save killed between its two renames left the old checkpoint_last as .replaced-...
    and the new one staged: the old one, complete, is the one to keep."""
    def complete(path: Path, tag: str) -> None:
        path.mkdir()
        for name in (".metadata", "distlm.json", "__0_0.distcp"):
            (path / name).write_text(tag)

    complete(tmp_path / f".replaced-{checkpoint.LAST}", "old")
    complete(incomplete(tmp_path, checkpoint.LAST), "new, not committed")
    complete(tmp_path / checkpoint.numbered(2), "kept")
    (incomplete(tmp_path, checkpoint.numbered(4))).mkdir()
    actions = recover(tmp_path)
    assert len(actions) == 3, actions
    assert saved_names(tmp_path) == [checkpoint.numbered(2), checkpoint.LAST]
    assert (tmp_path / checkpoint.LAST / "distlm.json").read_text() == "old"

    # commit replaces an existing checkpoint by its staged successor.
    complete(incomplete(tmp_path, checkpoint.LAST), "newer")
    commit(tmp_path, checkpoint.LAST)
    assert saved_names(tmp_path) == [checkpoint.numbered(2), checkpoint.LAST]
    assert (tmp_path / checkpoint.LAST / "distlm.json").read_text() == "newer"


def test_an_epoch_that_ends_on_a_skipped_update_still_gets_its_checkpoint(tmp_path):
    """Update 4 was saved (checkpoint_4 and checkpoint_last); the next update overflows and
    ends epoch 2 without moving the count: only the epoch's own name is new."""
    settings = parse_args(["--save-dir", str(tmp_path), "--save-interval-updates", "4"]).checkpoint
    saver = Checkpointer(settings, ctx=None, arch=ARCH, task="causal_lm")
    assert saver.due(4, None, False) == [checkpoint.numbered(4), checkpoint.LAST]
    saver._saved_at = 4
    assert saver.due(4, None, False) == []
    assert saver.due(4, 2, False) == [checkpoint.epoch_name(2)]
    settings.no_epoch_checkpoints = True
    assert saver.due(4, 2, False) == []


def test_the_accelerators_rng_is_captured_and_restored_whatever_its_device_type(monkeypatch):
    """Through torch.accelerator: a Neuron device's generator is kept as CUDA's is."""
    from distlm.checkpoint.stateful import capture_rng, restore_rng

    class NeuronModule:
        state = torch.tensor([1, 2, 3], dtype=torch.uint8)

        def get_rng_state(self):
            return self.state.clone()

        def set_rng_state(self, state):
            self.state = state.clone()

    neuron = NeuronModule()
    # TorchNeuron renames the privateuse1 device; without it torch.device("neuron") is refused.
    monkeypatch.setattr(torch.accelerator, "current_accelerator", lambda: types.SimpleNamespace(type="neuron"))
    monkeypatch.setattr(torch, "get_device_module", lambda device_type: neuron)
    saved = capture_rng()
    assert set(saved) == {"cpu", "neuron"} and torch.equal(saved["neuron"], NeuronModule.state)
    neuron.state = torch.tensor([9], dtype=torch.uint8)
    restore_rng(saved)
    assert torch.equal(neuron.state, NeuronModule.state)
