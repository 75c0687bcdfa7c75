"""Checkpoints that can be trusted: state as Stateful objects, old checkpoints resuming
exactly, no code run from a checkpoint, checksums, one owner per save dir, and a resume
that checks the model and names changed settings.

One small model (tests/fixtures/checkpoint_33fbac2: 3,120 parameters, its own data)
serves every check; its runs are shared through the module fixture ``runs``. What needs
two ranks (a flipped byte) runs in test_checkpoint.py's 2-rank job.

A crafted checkpoint here has its checksums rewritten to match, as whoever crafts one
can: checksums are not signatures, so the reading itself must refuse.
"""

from __future__ import annotations

import hashlib
import io
import json
import logging
import math
import os
import pickle
import shutil
import socket
import subprocess
import sys
import time
import zlib
from pathlib import Path

import numpy as np
import pytest
import torch
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import BytesStorageMetadata, MetadataIndex

from distlm import checkpoint
from distlm.export import cli as export
from distlm.checkpoint import CheckpointReader, directory, integrity, storage
from distlm.checkpoint.lock import LOCK_FILE, SaveDirLock
from distlm.config import parse_args
from distlm.data.indexed_dataset import write_indexed_dataset
from distlm.data.tokenizer import byte_dictionary
from distlm.errors import UsageError
from distlm.train import main
from distlm.training.trainer import Trainer
from test_checkpoint import assert_same_checkpoint, fit

FIXTURE = Path(__file__).parent / "fixtures" / "checkpoint_33fbac2"
DATA = str(FIXTURE / "data")


def tiny_args(save_dir: Path | str, max_update: int, extra: list[str] = ()) -> list[str]:
    """The settings the fixture was made with (make_fixture.py), dropout on."""
    return [
        "--data", DATA, "--arch", "llama_tiny", "--decoder-embed-dim", "16", "--decoder-layers", "1",
        "--decoder-ffn-embed-dim", "32", "--decoder-attention-heads", "2", "--kv-heads", "2",
        "--tokens-per-sample", "16", "--batch-size", "2", "--dropout", "0.1", "--attention-dropout", "0.1",
        "--lr", "1e-3", "--warmup-updates", "1", "--total-num-update", "4", "--max-update", str(max_update),
        "--log-interval", "1000", "--disable-validation", "--save-dir", str(save_dir), "--device", "cpu",
        "--seed", "3", "--no-epoch-checkpoints", *extra,
    ]


class Counter:
    """A Stateful holding a tensor: saved in the shards under its name."""

    def __init__(self):
        self.total = torch.zeros(3)

    def state_dict(self):
        return {"total": self.total}

    def load_state_dict(self, state):
        self.total.copy_(state["total"])


class Tag:
    """A Stateful without tensors: saved in distlm.json under its name."""

    def __init__(self):
        self.note = "fresh"

    def state_dict(self):
        return {"note": self.note}

    def load_state_dict(self, state):
        self.note = state["note"]


def byte_level_data(root: Path) -> str:
    """A data directory whose dictionary is byte-level, so that a save writes tokenizer files."""
    root.mkdir()
    byte_dictionary().save(root / "dict.txt")
    rng = np.random.default_rng(0)
    write_indexed_dataset(str(root / "train"), [np.append(rng.integers(4, 260, size=12), 2) for _ in range(16)],
                          np.uint16)
    return str(root)


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> Path:
    """root/straight: 4 updates (checkpoint_2, checkpoint_4); root/old: the fixture's
    checkpoint of update 2, written by commit 33fbac2, resumed to 4 with two states registered;
    root/two-layers: 2 updates of the model with 2 layers (checkpoint_1, checkpoint_2);
    root/bytes: 1 update on byte-level data (its checkpoint holds tokenizer files, root/bytes-data)."""
    root = tmp_path_factory.mktemp("trust")
    fit(tiny_args(root / "straight", 4, ["--save-interval-updates", "2"]))
    shutil.copytree(FIXTURE / "save", root / "old")
    states = {"counter": Counter(), "tag": Tag()}
    # Written before checksums were recorded, it is read only when told not to verify.
    trainer = Trainer(parse_args(tiny_args(root / "old", 4, ["--no-verify-checkpoint"])), states=states)
    assert trainer.resumed_at == 2
    # The old checkpoint holds neither: they keep what they had.
    assert torch.equal(states["counter"].total, torch.zeros(3)) and states["tag"].note == "fresh"
    states["counter"].total += torch.tensor([1.0, 2.0, 3.0])
    states["tag"].note = "resumed once"
    trainer.fit()
    fit(tiny_args(root / "two-layers", 2, ["--decoder-layers", "2", "--save-interval-updates", "1"]))
    fit(tiny_args(root / "bytes", 1, ["--data", byte_level_data(root / "bytes-data")]))
    return root


def run_main(argv: list[str], capsys) -> tuple[int, list[str]]:
    code = main(argv)
    return code, [line for line in capsys.readouterr().err.splitlines() if line.startswith("distlm: error:")]


def run_export(argv: list[str], capsys) -> tuple[int, list[str]]:
    code = export.main(argv)
    return code, capsys.readouterr().err.strip().splitlines()


@pytest.fixture
def never_trains(monkeypatch):
    def train_step(*args, **kwargs):
        raise AssertionError("training started")
    monkeypatch.setattr(Trainer, "train_step", train_step)


# ------------------------------------------------------------ state as Stateful


# The fixture's updates ran AdamW's foreach kernel; this code runs the fused one on the CPU,
# which computes the same float32 update in another order: each update may round each value
# differently by a few ulps (tests/test_optim.py allows 4), so after n updates 4n ulps.
# The fixture was also written on another CPU, whose matrix kernels sum in another order: a
# gradient that is a difference of nearly equal terms can differ there by 1e-4 of itself, and
# from its second update on Adam moves a weight by --lr times a ratio of gradients, so by up to
# 1e-4 x --lr (1e-3) more.
def ulps_after(updates: int) -> dict[str, float]:
    return {"rtol": 4 * updates * torch.finfo(torch.float32).eps, "atol": 1e-4 * 1e-3}


def test_a_checkpoint_of_the_previous_release_resumes_exactly(runs):
    """The fixture (commit 33fbac2's code) holds what this code writes at update 2, and
    resumed from it the run ends where the straight one does, to the optimizer kernel's rounding."""
    old = CheckpointReader(FIXTURE / "save", verify=False)  # it records no checksums
    new = CheckpointReader(runs / "straight" / checkpoint.numbered(2))
    assert old.keys() == new.keys()
    for key in new.keys():
        torch.testing.assert_close(old.tensor(key), new.tensor(key), **ulps_after(2), msg=key)
    resumed, straight = (checkpoint.load(runs / name / checkpoint.LAST) for name in ("old", "straight"))
    assert (resumed["num_updates"], resumed["consumed_samples"]) == (straight["num_updates"],
                                                                     straight["consumed_samples"])
    torch.testing.assert_close(resumed["model"], straight["model"], **ulps_after(4))
    torch.testing.assert_close(resumed["optimizer"]["state"], straight["optimizer"]["state"], **ulps_after(4))


def test_a_registered_stateful_is_saved_and_resumed_without_changing_the_checkpointer(runs):
    saved = runs / "old" / checkpoint.LAST
    assert torch.equal(CheckpointReader(saved).tensor("counter.total"), torch.tensor([1.0, 2.0, 3.0]))
    assert json.loads((saved / "distlm.json").read_text())["tag"] == {"note": "resumed once"}
    states = {"counter": Counter(), "tag": Tag()}
    assert Trainer(parse_args(tiny_args(runs / "old", 4)), states=states).resumed_at == 4
    assert torch.equal(states["counter"].total, torch.tensor([1.0, 2.0, 3.0])) and states["tag"].note == "resumed once"


# ------------------------------------------------------------ no code from a checkpoint


class Payload:
    """Unpickled, it creates the marker file: what a crafted checkpoint would run."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return exec, (f"open({str(self.marker)!r}, 'w').write('ran')",)


def rewrite_checksums(path: Path) -> None:
    """Record every file of the checkpoint directory ``path`` as it now is, as a save records them."""
    meta = json.loads((path / "distlm.json").read_text())
    names = [str(file.relative_to(path)) for file in sorted(path.rglob("*")) if file.is_file()]
    meta["files"] = integrity.digests(path, [name for name in names if name != "distlm.json"])
    (path / "distlm.json").write_text(json.dumps(meta))


def crafted_checkpoints(source: Path, root: Path, marker: Path) -> dict[str, Path]:
    """Save dirs whose checkpoint_last carries code: in DCP's .metadata, in a weight marked
    as a non-tensor entry (which DCP reads with torch.load(weights_only=False)), and in the
    record of a tensor entry (read with weights_only=True, whose refusal is torch's text
    in terminal colours), as a pickle of protocol 2 and of the default protocol."""
    crafted = {}
    for kind in ("metadata", "bytes-entry", "tensor-entry", "tensor-entry-framed"):
        path = root / kind / checkpoint.LAST
        shutil.copytree(source, path)
        if kind.startswith("tensor-entry"):
            with open(path / ".metadata", "rb") as f:
                metadata = pickle.load(f)  # written by this test's own save
            key = "model.tok_embeddings.weight"
            # Padded to the bytes the tensor's shape needs: a shorter record is refused unread.
            payload = pickle.dumps(Payload(marker), protocol=2 if kind == "tensor-entry" else None) + bytes(4096)
            (path / "__9_0.distcp").write_bytes(payload)
            metadata.storage_data = {index: _StorageInfo("__9_0.distcp", 0, len(payload)) if index.fqn == key else info
                                     for index, info in metadata.storage_data.items()}
            (path / ".metadata").write_bytes(pickle.dumps(metadata))
        elif kind == "metadata":
            (path / ".metadata").write_bytes(pickle.dumps(Payload(marker)))
        else:
            with open(path / ".metadata", "rb") as f:
                metadata = pickle.load(f)  # written by this test's own save
            key = "model.tok_embeddings.weight"
            metadata.state_dict_metadata[key] = BytesStorageMetadata()
            metadata.storage_data = {index: info for index, info in metadata.storage_data.items() if index.fqn != key}
            payload = pickle.dumps(Payload(marker))
            (path / "__9_0.distcp").write_bytes(payload)
            metadata.storage_data[MetadataIndex(key)] = _StorageInfo("__9_0.distcp", 0, len(payload))
            (path / ".metadata").write_bytes(pickle.dumps(metadata))
        rewrite_checksums(path)
        crafted[kind] = path
    return crafted


def test_no_code_in_a_checkpoint_runs_on_resume_restore_finetune_or_export(runs, tmp_path, capsys, never_trains):
    marker = tmp_path / "marker"
    crafted = crafted_checkpoints(runs / "straight" / checkpoint.LAST, tmp_path, marker)
    # The payloads are live: unpickled as DCP and torch.load(weights_only=False) do, they run.
    pickle.loads((crafted["metadata"] / ".metadata").read_bytes())
    assert marker.exists()
    marker.unlink()
    with pytest.raises(RuntimeError, match="magic number"):  # raised after the payload ran
        torch.load(io.BytesIO((crafted["bytes-entry"] / "__9_0.distcp").read_bytes()), weights_only=False)
    assert marker.exists()
    marker.unlink()
    with pytest.raises(RuntimeError, match="magic number"):
        torch.load(io.BytesIO((crafted["tensor-entry"] / "__9_0.distcp").read_bytes()), weights_only=False)
    assert marker.exists()
    marker.unlink()
    named = {"metadata": str(crafted["metadata"] / ".metadata"), "bytes-entry": str(crafted["bytes-entry"] / ".metadata"),
             "tensor-entry": "it holds a Python object, exec, that only code could rebuild; distlm never runs it",
             "tensor-entry-framed": "it holds a pickle that torch's weights-only unpickler refuses; distlm never runs code"}
    for kind, path in crafted.items():
        attempts = {
            "resume": lambda: run_main(tiny_args(path.parent, 6), capsys),
            "restore": lambda: run_main(tiny_args(tmp_path / f"restore-{kind}", 6, ["--restore-file", str(path)]), capsys),
            "finetune": lambda: run_main(
                tiny_args(tmp_path / f"finetune-{kind}", 6, ["--finetune-from-model", str(path)]), capsys),
            "export --out": lambda: run_export(["--checkpoint", str(path), "--out", str(tmp_path / "out.safetensors")],
                                               capsys),
            "export --hf": lambda: run_export(["--checkpoint", str(path), "--hf", str(tmp_path / "hf")], capsys),
        }
        for name, attempt in attempts.items():
            code, lines = attempt()
            assert code == 2 and len(lines) == 1, (kind, name, lines)
            assert named[kind] in lines[0], (kind, name, lines)
            # Neither torch's terminal colours nor its advice to load with weights_only=False.
            assert "\x1b" not in lines[0] and "weights_only" not in lines[0], (kind, name, lines)
            assert not marker.exists(), (kind, name)
    assert not (tmp_path / "out.safetensors").exists()


# ------------------------------------------------------------ checksums


def flip_a_byte_of_a_weight(path: Path) -> tuple[str, Path]:
    """Flip one bit in the middle of the largest weight's record in its shard: (its key, the shard)."""
    metadata = storage.read_metadata(path)
    index, info = max(((index, info) for index, info in metadata.storage_data.items()
                       if index.fqn.startswith("model.")), key=lambda item: item[1].length)
    shard = path / info.relative_path
    data = bytearray(shard.read_bytes())
    data[info.offset + info.length // 2] ^= 0x10
    shard.write_bytes(data)
    return index.fqn, shard


def test_a_flipped_byte_is_refused_at_resume_and_export_naming_an_older_checkpoint(runs, tmp_path, capsys,
                                                                                 never_trains, caplog):
    save = tmp_path / "save"
    shutil.copytree(runs / "straight", save)
    key, shard = flip_a_byte_of_a_weight(save / checkpoint.LAST)
    # Without its checksum the damage reads as a weight like any other.
    original = CheckpointReader(runs / "straight" / checkpoint.LAST).tensor(key)
    assert not torch.equal(CheckpointReader(save / checkpoint.LAST, verify=False).tensor(key), original)
    code, lines = run_main(tiny_args(save, 6), capsys)
    assert code == 2 and len(lines) == 1, lines
    assert str(shard) in lines[0] and "--restore-file checkpoint_2" in lines[0], lines
    out = tmp_path / "out.safetensors"
    code, lines = run_export(["--checkpoint", str(save), "--out", str(out)], capsys)
    assert code == 2 and len(lines) == 1, lines
    assert str(shard) in lines[0] and f"--checkpoint {save / checkpoint.numbered(2)}" in lines[0], lines
    assert not out.exists()
    # Told not to verify, resume and export say so.
    intact = tmp_path / "intact"
    shutil.copytree(runs / "straight", intact)
    with caplog.at_level(logging.INFO, logger="distlm"):
        assert Trainer(parse_args(tiny_args(intact, 6, ["--no-verify-checkpoint"]))).resumed_at == 4
        assert export.main(["--checkpoint", str(intact), "--out", str(out), "--no-verify-checkpoint"]) == 0
    said = [r.getMessage() for r in caplog.records
            if f"{intact / checkpoint.LAST}: checksums not verified (--no-verify-checkpoint)" in r.getMessage()]
    assert len(said) == 2 and all(r.levelno == logging.WARNING for r in caplog.records if r.getMessage() in said), said


# One process without a process group is the intent here, as in the checkpointer's own saves.
@pytest.mark.filterwarnings("ignore:.*assuming the intent is to save in a single process")
def test_checksums_computed_while_writing_equal_the_files_read_back(tmp_path, monkeypatch):
    """DCP's shards and metadata are hashed as they are written (the metadata under its
    temporary name, then renamed); each entry equals CRC-32 and size of the file read back,
    and the commit's table takes them without reading the files again."""
    state = {"weight": torch.randn(300, 37), "nested": {"step": 3, "ids": torch.arange(10)}}
    writer = integrity.HashingWriter(tmp_path / "save")
    torch.distributed.checkpoint.save(state, storage_writer=writer, no_dist=True)
    hashed = writer.hashed()
    on_disk = sorted(str(path.relative_to(tmp_path / "save")) for path in (tmp_path / "save").rglob("*")
                     if path.is_file())
    assert ".metadata" in on_disk and sorted(hashed) == on_disk
    for name in on_disk:
        data = (tmp_path / "save" / name).read_bytes()
        assert hashed[name] == {"size": len(data), "crc32": f"{zlib.crc32(data):08x}"}, name
        assert integrity.digest(tmp_path / "save" / name) == hashed[name], name
    (tmp_path / "save" / "tokenizer.json").write_text("{}")  # a file the save copies in: read back

    def read_back(path: Path) -> dict:
        assert path.name == "tokenizer.json", f"{path} was read back"
        return {"size": 2, "crc32": "read"}
    monkeypatch.setattr(integrity, "digest", read_back)
    table = integrity.digests(tmp_path / "save", [*on_disk, "tokenizer.json"], hashed)
    assert table == {**hashed, "tokenizer.json": {"size": 2, "crc32": "read"}}


def test_an_older_table_of_sha256_checksums_still_verifies(runs, tmp_path):
    """A checkpoint saved before CRC-32 recorded each file's SHA-256 (read back from disk
    after the save): it still opens verified, and a flipped byte is still found."""
    path = tmp_path / checkpoint.LAST
    shutil.copytree(runs / "bytes" / checkpoint.LAST, path)
    meta = json.loads((path / "distlm.json").read_text())
    older = {name: {"size": len(data), "sha256": hashlib.sha256(data).hexdigest()}
             for name in meta["files"] for data in [(path / name).read_bytes()]}
    assert all(set(entry) == {"size", "crc32"} for entry in meta["files"].values())  # what a save writes now
    (path / "distlm.json").write_text(json.dumps({**meta, "files": older}))
    reader = CheckpointReader(path)
    assert reader.keys()
    shard = path / next(name for name in older if name.endswith(".distcp"))
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 1
    shard.write_bytes(bytes(data))
    with pytest.raises(UsageError, match=f"{shard} differs from what was written"):
        CheckpointReader(path)


def test_the_checksums_list_every_file_the_save_wrote_and_nothing_else_is_read(runs, tmp_path, capsys, caplog,
                                                                               never_trains):
    """The table lists DCP's shards and metadata and the tokenizer files. A table missing or
    empty (a tool that rewrote distlm.json, a checkpoint from before checksums) or a file the
    save did not write (added_tokens.json, which transformers would read) ends resume and
    export in one line; only --no-verify-checkpoint reads such a checkpoint, and says so."""
    saved = runs / "bytes" / checkpoint.LAST
    files = json.loads((saved / "distlm.json").read_text())["files"]
    shards = storage.shard_files(storage.read_metadata(saved))
    tokenizer = [f"tokenizer/{path.name}" for path in (saved / "tokenizer").iterdir()]
    assert shards and tokenizer and set(files) == {".metadata", *shards, *tokenizer}, files

    def copy(name: str, source: Path = saved) -> Path:
        path = tmp_path / name / checkpoint.LAST
        shutil.copytree(source, path)
        return path

    def with_files(name: str, files: dict | None) -> Path:
        path = copy(name)
        meta = json.loads((path / "distlm.json").read_text())
        if files is None:
            del meta["files"]
        else:
            meta["files"] = files
        (path / "distlm.json").write_text(json.dumps(meta))
        return path

    added = copy("added")
    (added / "tokenizer" / "added_tokens.json").write_text('{"<extra>": 300}')
    old = copy("old-release", FIXTURE / "save" / checkpoint.LAST)
    cases = {
        with_files("missing", None): "distlm.json: 'files' is missing, so its files cannot be verified",
        with_files("empty", {}): "distlm.json: 'files' is empty, so its files cannot be verified",
        added: f"{added / 'tokenizer' / 'added_tokens.json'} is not among the files its save wrote",
        old: "distlm.json: 'files' is missing, so its files cannot be verified",
    }
    for path, problem in cases.items():
        data = [] if path == old else ["--data", str(runs / "bytes-data")]
        for name, attempt in {
            "resume": lambda: run_main(tiny_args(path.parent, 6, data), capsys),
            "export --out": lambda: run_export(["--checkpoint", str(path), "--out", str(tmp_path / "out.safetensors")],
                                               capsys),
            "export --hf": lambda: run_export(["--checkpoint", str(path), "--hf", str(tmp_path / "hf")], capsys),
        }.items():
            code, lines = attempt()
            assert code == 2 and len(lines) == 1, (path, name, lines)
            assert problem in lines[0] and "--no-verify-checkpoint" in lines[0], (path, name, lines)
    assert not (tmp_path / "out.safetensors").exists() and not (tmp_path / "hf").exists()
    with caplog.at_level(logging.WARNING, logger="distlm"):
        assert export.main(["--checkpoint", str(added), "--hf", str(tmp_path / "hf"), "--no-verify-checkpoint"]) == 0
    assert (tmp_path / "hf" / "added_tokens.json").is_file()
    assert f"{added}: checksums not verified (--no-verify-checkpoint)" in caplog.messages


def test_a_crafted_shape_is_refused_before_anything_is_allocated(runs, tmp_path, capsys, monkeypatch, never_trains):
    """A weight's shape in .metadata made 64 TiB, its checksum rewritten: export ends in one
    line without allocating anything larger than the model, as resume does. A shape with the
    bytes the shards hold but not the model distlm.json describes is refused by resume's own
    comparison of names and shapes."""
    key = "model.tok_embeddings.weight"

    def crafted(name: str, shape: list[int]) -> Path:
        path = tmp_path / name / checkpoint.LAST
        shutil.copytree(runs / "straight" / checkpoint.LAST, path)
        with open(path / ".metadata", "rb") as f:
            metadata = pickle.load(f)  # written by this test's own save
        assert list(metadata.state_dict_metadata[key].size) == [16, 16]
        metadata.state_dict_metadata[key].size = torch.Size(shape)
        (path / ".metadata").write_bytes(pickle.dumps(metadata))
        rewrite_checksums(path)
        return path

    huge, reshaped = crafted("huge", [1 << 22, 1 << 22]), crafted("reshaped", [32, 8])
    expected = {
        huge: f"{huge / '.metadata'} gives {key} the shape [4194304, 4194304], 70,368,744,177,664 bytes, but its "
              "shards hold 2,601 bytes of it",
        reshaped: f"{reshaped} does not hold the model its distlm.json describes: tok_embeddings.weight is [32, 8] "
                  "in the checkpoint, [16, 16] in the model built",
    }
    requested = []
    allocate = torch.empty

    def empty(*size, **kwargs):
        shape = size[0] if len(size) == 1 and not isinstance(size[0], int) else size
        requested.append(math.prod(shape))  # before the allocation, which 64 TiB would not survive
        return allocate(*size, **kwargs)

    monkeypatch.setattr(torch, "empty", empty)
    for path, problem in expected.items():
        for flag, target in (("--out", tmp_path / "out.safetensors"), ("--hf", tmp_path / "hf")):
            code, lines = run_export(["--checkpoint", str(path), flag, str(target)], capsys)
            assert code == 2 and len(lines) == 1, (path, flag, lines)
            assert problem in lines[0], (path, flag, lines)
            assert not target.exists()
    # The largest request is the model's own rotary table (2048 positions x 4), built on the meta device.
    assert max(requested) <= 2048 * 4, max(requested)
    code, lines = run_main(tiny_args(huge.parent, 6), capsys)
    assert code == 2 and len(lines) == 1, lines
    assert "tok_embeddings.weight is [4194304, 4194304] in the checkpoint, [16, 16] in the model built" in lines[0]


def test_an_export_never_mixes_two_saves_of_a_checkpoint(runs, tmp_path, capsys, monkeypatch):
    """checkpoint_last replaced by a run's next save while the export reads it: the export
    ends in one line and writes nothing."""
    save = tmp_path / "save"
    shutil.copytree(runs / "straight", save)
    read, original = [], CheckpointReader.tensors

    def tensors_then_a_save_lands(self, keys):
        found = original(self, keys)
        if not read:
            read.append(keys)
            shutil.copytree(save / checkpoint.numbered(2), directory.incomplete(save, checkpoint.LAST))
            directory.commit(save, checkpoint.LAST)
        return found

    monkeypatch.setattr(CheckpointReader, "tensors", tensors_then_a_save_lands)
    out = tmp_path / "out.safetensors"
    code, lines = run_export(["--checkpoint", str(save), "--out", str(out)], capsys)
    assert read and code == 2 and len(lines) == 1, lines
    assert "was replaced by a newer save while it was read" in lines[0]
    assert not out.exists()


def test_a_linked_checkpoint_last_is_replaced_and_what_a_killed_save_left_is_removed(tmp_path, monkeypatch):
    """checkpoint_last made a link to checkpoint_2 by hand: a save replaces the link, never
    what it leads to, and leaves nothing beside it. Killed between stepping the link aside
    and removing it, the save leaves .replaced-checkpoint_last, which the next start removes."""
    def complete(path: Path, tag: str) -> None:
        path.mkdir()
        for name in (".metadata", "distlm.json", "__0_0.distcp"):
            (path / name).write_text(tag)

    second, replaced = checkpoint.numbered(2), f".replaced-{checkpoint.LAST}"
    complete(tmp_path / second, "update 2")
    (tmp_path / checkpoint.LAST).symlink_to(second)
    complete(directory.incomplete(tmp_path, checkpoint.LAST), "update 4")
    directory.commit(tmp_path, checkpoint.LAST)
    assert sorted(os.listdir(tmp_path)) == [second, checkpoint.LAST]
    assert (tmp_path / checkpoint.LAST / "distlm.json").read_text() == "update 4"
    assert (tmp_path / second / "distlm.json").read_text() == "update 2"

    (tmp_path / checkpoint.LAST).replace(tmp_path / "update-4")
    (tmp_path / checkpoint.LAST).symlink_to(second)
    complete(directory.incomplete(tmp_path, checkpoint.LAST), "update 6")
    renames, rename = [], os.rename

    def rename_then_killed(source, target):
        rename(source, target)
        renames.append(target)
        if len(renames) == 2:  # the new checkpoint is in place, the link stepped aside
            raise KeyboardInterrupt

    with monkeypatch.context() as patch:
        patch.setattr(os, "rename", rename_then_killed)
        with pytest.raises(KeyboardInterrupt):
            directory.commit(tmp_path, checkpoint.LAST)
    assert (tmp_path / replaced).is_symlink()
    assert directory.recover(tmp_path) == [f"removed {replaced}"]
    assert sorted(os.listdir(tmp_path)) == [second, checkpoint.LAST, "update-4"]
    assert (tmp_path / checkpoint.LAST / "distlm.json").read_text() == "update 6"
    assert (tmp_path / second / "distlm.json").read_text() == "update 2"
    # Stepped aside with nothing put in its place, the link is the checkpoint to restore.
    shutil.rmtree(tmp_path / checkpoint.LAST)
    (tmp_path / replaced).symlink_to(second)
    assert directory.recover(tmp_path) == [f"restored {checkpoint.LAST} from an interrupted save"]
    assert os.readlink(tmp_path / checkpoint.LAST) == second


# ------------------------------------------------------------ one owner per save dir


def test_a_second_run_on_a_save_dir_is_refused_and_a_dead_runs_lock_taken_over(runs, tmp_path, capsys, monkeypatch,
                                                                               caplog):
    save = tmp_path / "save"
    first = subprocess.Popen([sys.executable, "-m", "distlm.train", *tiny_args(save, 1_000_000)],
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                             env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])})
    try:
        deadline = time.monotonic() + 120
        while not (save / LOCK_FILE).exists():
            assert first.poll() is None and time.monotonic() < deadline, "the first run never took its save dir"
            time.sleep(0.2)
        with monkeypatch.context() as patch:
            patch.setattr(Trainer, "train_step", lambda *args: pytest.fail("the second run trained"))
            code, lines = run_main(tiny_args(save, 1), capsys)
        assert code == 2 and len(lines) == 1, lines
        assert f"--save-dir {save} belongs to another run" in lines[0] and f"pid {first.pid}," in lines[0], lines
    finally:
        first.kill()
        first.wait()
    # Killed, it left its lock behind: its process is gone, so the next run takes over.
    with caplog.at_level(logging.INFO, logger="distlm"):
        fit(tiny_args(save, 1))
    assert any(f"took over the lock of run process {socket.gethostname()}:{first.pid} (its process {first.pid} "
               "is gone)" in record.getMessage() for record in caplog.records)
    assert not (save / LOCK_FILE).exists()  # given up at the end of the run


def test_a_lock_from_another_host_stands_until_it_is_stale_and_a_restarted_job_keeps_it(tmp_path, monkeypatch):
    lock = tmp_path / LOCK_FILE
    lock.write_text(json.dumps({"run": "torchrun job-7", "host": "elsewhere", "pid": 1, "since": "then"}))
    with pytest.raises(UsageError, match="belongs to another run \\(torchrun job-7, host elsewhere, pid 1"):
        SaveDirLock(tmp_path).acquire()
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "job-7")  # a restart of that job: the same owner
    mine = SaveDirLock(tmp_path)
    mine.acquire()
    assert json.loads(lock.read_text())["pid"] == os.getpid()
    mine.release()
    assert not lock.exists()
    monkeypatch.delenv("TORCHELASTIC_RUN_ID")
    lock.write_text(json.dumps({"run": "torchrun job-7", "host": "elsewhere", "pid": 1, "since": "then"}))
    os.utime(lock, (time.time() - 3600, time.time() - 3600))  # not refreshed for an hour
    SaveDirLock(tmp_path).acquire()
    assert json.loads(lock.read_text())["pid"] == os.getpid()


# ------------------------------------------------------------ a resume that checks the model and settings


def test_a_resume_into_fewer_layers_is_refused_and_a_partial_finetune_lists_what_it_left_out(runs, tmp_path,
                                                                                           capsys, caplog):
    saved = runs / "two-layers" / checkpoint.numbered(1)
    code, lines = run_main(tiny_args(tmp_path / "fewer", 4, ["--restore-file", str(saved)]), capsys)
    assert code == 2 and len(lines) == 1, lines
    assert (f"{saved} is a checkpoint of another model: the checkpoint has layers.1.attention.wq.weight, "
            "the model built does not") in lines[0], lines
    with caplog.at_level(logging.INFO, logger="distlm"):
        trainer = Trainer(parse_args(tiny_args(tmp_path / "partial", 4, ["--finetune-from-model", str(saved),
                                                                         "--load-partial"])))
    line = next(r.getMessage() for r in caplog.records if r.getMessage().startswith("--load-partial"))
    assert "left out: layers.1." in line and "layers.0." not in line.split("left out:")[1], line
    reader = CheckpointReader(saved)
    for name, value in trainer.model.state_dict().items():
        assert torch.equal(value, reader.tensor(f"model.{name}")), name


def test_a_resume_with_a_changed_lr_and_batch_size_says_so(runs, tmp_path, caplog):
    saved = runs / "two-layers" / checkpoint.numbered(1)
    with caplog.at_level(logging.INFO, logger="distlm"):
        trainer = Trainer(parse_args(tiny_args(tmp_path / "lr", 4, [
            "--restore-file", str(saved), "--decoder-layers", "2", "--lr", "5e-4", "--batch-size", "4"])))
    assert trainer.resumed_at == 1
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("resuming with")]
    assert len(lines) == 1, lines
    assert all(change in lines[0] for change in ("lr 0.001 → 0.0005", "batch-size 2 → 4", "global batch 2 → 4")), lines
    # The position is one count of samples: the next update reads on from there.
    assert "carries over as 2 samples consumed" in lines[0] and trainer.consumed_samples == 2, lines
