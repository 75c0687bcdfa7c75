"""The faster paths of saving and loading compute what the slower ones did: a save that
hashes each byte once writes a checkpoint that loads to the same tensors and whose
checksums verify; a load that reads the records into the tensors and verifies the shards
as it reads them loads the same tensors, reads each shard once and still finds a damaged
byte. Speed itself is measured by benchmarks/checkpoint.py --disk-speed, never here.
"""

from __future__ import annotations

import io
import os
import zipfile
import zlib
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.filesystem import FileSystemReader, _StorageInfo
from torch.distributed.checkpoint.metadata import MetadataIndex
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, ReadItem

from distlm.checkpoint import integrity, storage, verified_read
from distlm.checkpoint.verified_read import VerifyingReader

# One process without a process group is the intent here, as in the checkpointer's own saves.
pytestmark = pytest.mark.filterwarnings("ignore:.*assuming the intent is to (save|load) in a single process")


def a_state() -> dict:
    generator = torch.Generator().manual_seed(0)
    return {
        "model": {"embed": torch.randn(3000, 200, generator=generator), "bias": torch.randn(7, generator=generator),
                  "head": torch.randn(200, 3000, generator=generator)},
        "optimizer": {"embed": {"step": torch.tensor(3.0), "exp_avg": torch.randn(3000, 200, generator=generator)}},
    }


def zeros_like(state: dict) -> dict:
    return {key: zeros_like(value) if isinstance(value, dict) else torch.zeros_like(value)
            for key, value in state.items()}


def assert_equal_states(loaded: dict, expected: dict) -> None:
    for key, value in expected.items():
        if isinstance(value, dict):
            assert_equal_states(loaded[key], value)
        else:
            assert torch.equal(loaded[key], value), key


def save(state: dict, path: Path) -> dict[str, dict]:
    """``state`` saved as distlm's writer saves; returns the checksums it recorded."""
    writer = integrity.HashingWriter(path)
    dcp.save(state, storage_writer=writer, no_dist=True)
    return writer.hashed()


# ------------------------------------------------------------------ saving


def test_a_save_without_the_zips_checksums_loads_the_same_tensors_and_its_checksums_verify(tmp_path):
    state = a_state()
    hashed = save(state, tmp_path / "save")
    assert torch.serialization.get_crc32_options()  # torch's setting is back for everyone else
    for name, entry in hashed.items():
        data = (tmp_path / "save" / name).read_bytes()
        assert entry == {"size": len(data), "crc32": f"{zlib.crc32(data):08x}"}, name
    assert integrity.verify(tmp_path / "save", hashed) is None
    loaded = zeros_like(state)
    dcp.load(loaded, storage_reader=FileSystemReader(tmp_path / "save"), no_dist=True)  # torch's own reader
    assert_equal_states(loaded, state)
    # The records were written without the zip's CRC-32, which the file's own covers.
    metadata = storage.read_metadata(tmp_path / "save")
    info = next(info for index, info in metadata.storage_data.items() if index.fqn == "model.embed")
    with open(tmp_path / "save" / info.relative_path, "rb") as f:
        f.seek(info.offset)
        record = zipfile.ZipFile(io.BytesIO(f.read(info.length)))
    assert {entry.CRC for entry in record.infolist() if entry.file_size > 1000} == {0}


def test_the_zips_checksums_stay_off_until_the_last_of_overlapping_saves_ends():
    assert torch.serialization.get_crc32_options()
    with integrity.zip_checksums_off():
        with integrity.zip_checksums_off():
            assert not torch.serialization.get_crc32_options()
        assert not torch.serialization.get_crc32_options()
    assert torch.serialization.get_crc32_options()
    torch.serialization.set_crc32_options(False)  # a user's own choice is kept
    try:
        with integrity.zip_checksums_off():
            pass
        assert not torch.serialization.get_crc32_options()
    finally:
        torch.serialization.set_crc32_options(True)


# ------------------------------------------------------------------ loading


@pytest.fixture
def counted_reads(monkeypatch) -> list[int]:
    """Bytes the verifying reader reads, one entry a read; a shard is never read back whole."""
    reads: list[int] = []
    read = os.preadv

    def counting(fd, buffers, offset):
        count = read(fd, buffers, offset)
        reads.append(count)
        return count

    monkeypatch.setattr(verified_read.os, "preadv", counting)
    monkeypatch.setattr(integrity, "digest", lambda path, *args: pytest.fail(f"{path} was read back whole"))
    return reads


def shards(hashed: dict[str, dict]) -> dict[str, dict]:
    return {name: entry for name, entry in hashed.items() if name.endswith(".distcp")}


def test_a_verified_load_reads_each_shard_once_and_loads_the_same_tensors(tmp_path, counted_reads):
    state = a_state()
    hashed = shards(save(state, tmp_path / "save"))
    loaded = zeros_like(state)
    reader = VerifyingReader(tmp_path / "save", hashed)
    storage.load(loaded, tmp_path / "save", no_dist=True, reader=reader)
    assert reader.problem is None
    assert_equal_states(loaded, state)
    size = sum(entry["size"] for entry in hashed.values())
    # Once, give or take the few bytes of zip headers torch.load reads out of order.
    assert size <= sum(counted_reads) <= size + 64 * 1024, (size, sum(counted_reads))


def test_a_load_reads_the_bytes_straight_into_the_tensors_where_they_fit_and_as_dcp_does_elsewhere(tmp_path,
                                                                                                  monkeypatch):
    """The records' layouts are read alone (onto the meta device) and their bytes into the
    tensors being loaded; a tensor of another dtype takes torch.load's tensor, converted."""
    state = a_state()
    hashed = shards(save(state, tmp_path / "save"))
    loads = []
    load = torch.load

    def recording(*args, **kwargs):
        loads.append(str(kwargs["map_location"]))
        return load(*args, **kwargs)

    monkeypatch.setattr(verified_read.torch, "load", recording)
    loaded = zeros_like(state)
    storage.load(loaded, tmp_path / "save", no_dist=True, reader=VerifyingReader(tmp_path / "save", hashed))
    assert_equal_states(loaded, state)
    assert set(loads) == {"meta"} and len(loads) == 5
    loads.clear()
    wider = {"model": {"embed": torch.zeros(3000, 200, dtype=torch.float64)}}
    reader = VerifyingReader(tmp_path / "save", hashed)
    storage.load(wider, tmp_path / "save", no_dist=True, reader=reader)
    assert reader.problem is None and loads == ["meta", "cpu"]
    assert torch.equal(wider["model"]["embed"], state["model"]["embed"].double())


def test_a_load_of_part_of_a_shard_still_verifies_it_whole(tmp_path, counted_reads):
    state = a_state()
    hashed = shards(save(state, tmp_path / "save"))
    part = {"model": {"bias": torch.zeros(7)}}
    reader = VerifyingReader(tmp_path / "save", hashed)
    storage.load(part, tmp_path / "save", no_dist=True, reader=reader)
    assert reader.problem is None and torch.equal(part["model"]["bias"], state["model"]["bias"])
    assert sum(counted_reads) >= sum(entry["size"] for entry in hashed.values())


@pytest.mark.parametrize("where", ["tensor", "header", "unread"])
def test_a_damaged_byte_is_found_while_reading_wherever_it_is(tmp_path, where):
    """In a tensor's bytes (torch.load reads a wrong value), in a record's zip header
    (torch.load fails) or in a record the load does not want: the file is named."""
    state = a_state()
    hashed = shards(save(state, tmp_path / "save"))
    metadata = storage.read_metadata(tmp_path / "save")
    fqn = "model.bias" if where == "unread" else "model.embed"
    info = next(info for index, info in metadata.storage_data.items() if index.fqn == fqn)
    shard = tmp_path / "save" / info.relative_path
    data = bytearray(shard.read_bytes())
    data[info.offset + (1 if where == "header" else info.length // 2)] ^= 0x10
    shard.write_bytes(bytes(data))
    wanted = {"model": {"embed": torch.zeros(3000, 200)}}
    reader = VerifyingReader(tmp_path / "save", hashed)
    storage.load(wanted, tmp_path / "save", no_dist=True, reader=reader)
    assert reader.problem == integrity.differs(shard, "crc32")


def a_plan(reads: list[tuple[str, int]]) -> LoadPlan:
    return LoadPlan([ReadItem(LoadItemType.TENSOR, MetadataIndex(fqn), torch.Size([0]), MetadataIndex(fqn),
                              torch.Size([0]), torch.Size([1])) for fqn, _ in reads])


def test_each_shard_is_verified_by_the_rank_that_reads_most_of_it_and_the_rest_shared_out(tmp_path):
    files = {"__0_0.distcp": 100, "__1_0.distcp": 90, "__2_0.distcp": 50, "__3_0.distcp": 40}
    layout = {"a": ("__0_0.distcp", 0, 100), "b": ("__1_0.distcp", 0, 60), "c": ("__1_0.distcp", 60, 30),
              "d": ("__2_0.distcp", 0, 50), "e": ("__3_0.distcp", 0, 40)}
    reader = VerifyingReader(tmp_path, {name: {"size": size, "crc32": "0"} for name, size in files.items()})
    reader.storage_data = {MetadataIndex(fqn): _StorageInfo(name, offset, length)
                           for fqn, (name, offset, length) in layout.items()}
    # Rank 0 loads its own shard and a little of rank 1's, rank 1 the rest of its own;
    # both load all of __2_0 (replicated), neither __3_0.
    plans = [a_plan([("a", 100), ("c", 30), ("d", 50)]), a_plan([("b", 60), ("d", 50)])]
    verifiers = [plan.storage_data for plan in reader.prepare_global_plan(plans)]
    assert verifiers == [["__0_0.distcp", "__3_0.distcp"], ["__1_0.distcp", "__2_0.distcp"]]
    assert [plan.items for plan in reader.prepare_global_plan(plans)] == [plan.items for plan in plans]
