"""Checkpoint save and load time, peak host memory per rank, and the training stall per save,
synchronous against ``--async-save``, for each strategy on a model of 100M parameters.

    torchrun --standalone --nproc_per_node 2 benchmarks/checkpoint.py              # ddp, fsdp, zero1
    torchrun --standalone --nproc_per_node 4 benchmarks/checkpoint.py --strategies zero1-tp2

The model is llama_tiny widened to 101M parameters (dim 1024, 6 layers, SwiGLU inner size
4096) on a small synthetic corpus; fp32 AdamW, so a checkpoint holds 12 bytes per
parameter (1.2 GB). For each strategy one Trainer is built and driven through two
Checkpointers of its own, one synchronous and one asynchronous, each with its own save
dir. Every round measures, in a rotating order:

- ``baseline``: ``--steps`` updates without a save;
- ``sync`` and ``async``: a save of ``checkpoint_last``, then the same updates, then
  waiting for the save to be on disk. The stall is that time minus the baseline: what the
  save cost the training run. ``blocked_s`` is how long the save call itself held the
  training loop (for async: staging a copy into host memory);
- ``load``: the checkpoint just written, read back into the same model and optimizer;
- ``checksums``: the same training state saved by ``torch.distributed.checkpoint.save``
  alone three ways: without checksums (``plain``), each file's CRC-32 computed while writing
  it, as a save does (``hashing``), and SHA-256 by reading the files back after the plain save,
  as saves did before (``read_back``); the report gives each one's overhead over ``plain``.

Peak host memory is the kernel's high-water mark of each rank's resident memory, reset
before the save (or load) and read when it is on disk, minus what the rank held before:
what saving or loading costs on top of the training state. Load times read files the
page cache still holds (they were written just before), as a resume right after a save
would. Rounds interleave because this machine is shared and noisy; the report gives
medians. Prints one JSON object (rank 0).

    torchrun --standalone --nproc_per_node 2 benchmarks/checkpoint.py --disk-speed   # roberta_large

``--disk-speed`` measures instead whether checkpoints go at the disk's speed: roberta_large's
training state (model and Adam, fp32) under FSDP on 2 ranks, each rank writing its half, saved
by ``dd oflag=direct`` (the file system's sequential bandwidth, the same bytes per rank), by raw
``torch.distributed.checkpoint.save`` and by distlm's Checkpointer; loaded back by ``dd
iflag=direct``, raw DCP and distlm (verifying checksums, and without), each after the page
cache was dropped (``cold_reads``; warm loads beside them). A raw DCP save with distlm's
checksums against one without any gives their cost; an asynchronous save gives the training
loop's stall, in steps. Then one process alone loads the 2-rank checkpoint (a resharding load)
against dd and raw DCP, and the candidate checksums are timed in memory.
"""

from __future__ import annotations

import argparse
import copy
import ctypes
import gc
import hashlib
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import zlib
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.filesystem import FileSystemWriter
from torch.distributed.tensor import DTensor

from distlm.backends.hardware import cpu_model_and_flags
from distlm.checkpoint import LAST, Checkpointer, integrity
from distlm.config import parse_args
from distlm.data.indexed_dataset import write_indexed_dataset
from distlm.training.memory import memory_report
from distlm.mesh import ParallelDims
from distlm.errors import exit_without_teardown
from distlm.training.trainer import Trainer

STRATEGIES = {
    "ddp": ["--strategy", "ddp"],
    "fsdp": ["--strategy", "fsdp"],
    "zero1": ["--strategy", "zero1"],
    "zero1-tp2": ["--strategy", "zero1", "--tp-degree", "2"],
}
MODEL = ["--arch", "llama_tiny", "--decoder-embed-dim", "1024", "--decoder-ffn-embed-dim", "4096",
         "--decoder-attention-heads", "16", "--kv-heads", "16"]


class PeakResidentBytes:
    """Peak resident memory of this process inside the block, above what it held at the start.

    torch's CPU tensors and DCP's file buffers are invisible to tracemalloc; the kernel
    counts every resident page. Writing 5 to /proc/self/clear_refs resets its high-water
    mark (VmHWM), so the peak is exact; malloc_trim first returns freed heap pages, so
    memory freed earlier cannot hide new allocations.
    """

    def __enter__(self) -> PeakResidentBytes:
        gc.collect()
        ctypes.CDLL("libc.so.6").malloc_trim(0)
        Path("/proc/self/clear_refs").write_text("5")
        self.start = _status_bytes("VmRSS")
        return self

    def __exit__(self, *exc_info) -> None:
        self.bytes = _status_bytes("VmHWM") - self.start


def _status_bytes(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"/proc/self/status has no {field}")


def write_corpus(directory: Path) -> None:
    """A fairseq-preprocess style directory: 40 words, 400 sentences (the same on every rank)."""
    rng = np.random.default_rng(0)
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "dict.txt").write_text("".join(f"w{i} {1000 - i}\n" for i in range(40)))
    sentences = [np.append(rng.integers(4, 44, size=rng.integers(8, 60)), 2) for _ in range(400)]
    write_indexed_dataset(str(directory / "train"), sentences, np.uint16)


class Bench:
    """One strategy's Trainer with a synchronous and an asynchronous Checkpointer."""

    def __init__(self, name: str, flags: list[str], data: Path, save_dir: Path, args: argparse.Namespace,
                 model: list[str] | None = None):
        world_size = int(os.environ["WORLD_SIZE"])
        tp = int(flags[flags.index("--tp-degree") + 1]) if "--tp-degree" in flags else 1
        batch = max(1, args.global_batch // ParallelDims(world_size=world_size, tp=tp).dp)
        model = model or [*MODEL, "--decoder-layers", str(args.layers)]
        argv = [
            "--data", str(data), *model, *flags, "--tokens-per-sample", str(args.tokens_per_sample),
            "--batch-size", str(batch), "--dropout", "0", "--attention-dropout", "0", "--max-update", "1000000",
            "--log-interval", "1000000", "--disable-validation", "--device", "cpu", "--save-dir", str(save_dir / name),
        ]
        self.name = name
        self.trainer = Trainer(parse_args(argv))
        self.batches = self.trainer.update_batches()
        self.step()  # Adam's moments exist from here on
        self.checkpointers = {}
        for mode in ("sync", "async"):
            settings = copy.deepcopy(self.trainer.config.checkpoint)
            settings.save_dir, settings.async_save = str(save_dir / name / mode), mode == "async"
            checkpointer = Checkpointer(settings, self.trainer.ctx, self.trainer.arch, self.trainer.task)
            checkpointer.prepare()
            self.checkpointers[mode] = checkpointer

    def step(self) -> None:
        self.trainer.train_step(next(self.batches))

    def steps(self, count: int) -> None:
        for _ in range(count):
            self.step()

    def save(self, mode: str) -> None:
        trainer = self.trainer
        # No description beyond the training state (config, dictionary): a few kB, not measured here.
        self.checkpointers[mode].save([LAST], trainer.states, {})

    def stall_round(self, mode: str, steps: int) -> dict[str, float]:
        """``steps`` updates after a save (none for the baseline), until the save is on disk."""
        dist.barrier()
        start = time.perf_counter()
        if mode != "baseline":
            self.save(mode)
        blocked = time.perf_counter() - start
        self.steps(steps)
        if mode != "baseline":
            self.checkpointers[mode].wait()
        dist.barrier()
        return {"total_s": time.perf_counter() - start, "blocked_s": blocked}

    def checksum_round(self, mode: str, directory: Path) -> float:
        """Seconds of one ``dcp.save`` of the training state into a fresh ``directory``
        (``plain``, ``hashing`` or ``read_back``: see the module's docstring)."""
        shutil.rmtree(directory, ignore_errors=True)
        state = {key: stateful.state_dict() for key, stateful in self.trainer.states.items()}
        writer = integrity.HashingWriter(directory) if mode == "hashing" else FileSystemWriter(directory)
        dist.barrier()
        start = time.perf_counter()
        dcp.save(state, storage_writer=writer)
        if mode == "read_back":
            mine = [str(path.relative_to(directory)) for path in directory.rglob("*")
                    if path.is_file() and path.name.startswith(f"__{dist.get_rank()}_")]
            for name in mine:
                integrity.digest(directory / name, "sha256")
        dist.barrier()
        return time.perf_counter() - start

    def memory_round(self, mode: str) -> dict[str, float]:
        """One save until it is on disk, then a load of it: times and peak bytes, no training in between."""
        dist.barrier()
        with PeakResidentBytes() as saving:
            start = time.perf_counter()
            self.save(mode)
            self.checkpointers[mode].wait()
            dist.barrier()
            saved = time.perf_counter() - start
        checkpointer = self.checkpointers[mode]
        resume = checkpointer.find_resume()
        trainer = self.trainer
        with PeakResidentBytes() as loading:
            start = time.perf_counter()
            checkpointer.load(resume, trainer.states, trainer.config.seed)
            dist.barrier()
            loaded = time.perf_counter() - start
        return {"save_s": saved, "load_s": loaded, "save_peak_bytes": saving.bytes, "load_peak_bytes": loading.bytes}


def median(values: list[float]) -> float:
    return round(statistics.median(values), 3)


def run(bench: Bench, args: argparse.Namespace) -> dict:
    stalls = {mode: [] for mode in ("baseline", "sync", "async")}
    memory = {mode: [] for mode in ("sync", "async")}
    checksums = {mode: [] for mode in ("plain", "hashing", "read_back")}
    order = list(stalls)
    for round_index in range(args.rounds):
        shift = round_index % len(order)
        for mode in order[shift:] + order[:shift]:
            stalls[mode].append(bench.stall_round(mode, args.steps))
        for mode in (["sync", "async"] if round_index % 2 == 0 else ["async", "sync"]):
            memory[mode].append(bench.memory_round(mode))
        modes = list(checksums)
        for mode in modes[round_index % 3:] + modes[:round_index % 3]:
            checksums[mode].append(bench.checksum_round(mode, args.scratch / "checksums" / bench.name))
    baseline = median([r["total_s"] for r in stalls["baseline"]])
    per_rank = {}
    for mode in ("sync", "async"):
        mine = {key: median([r[key] for r in memory[mode]]) for key in ("save_s", "load_s")}
        mine.update({key: max(r[key] for r in memory[mode]) for key in ("save_peak_bytes", "load_peak_bytes")})
        mine["blocked_s"] = median([r["blocked_s"] for r in stalls[mode]])
        mine["stall_s"] = round(statistics.median([r["total_s"] for r in stalls[mode]]) - baseline, 3)
        everyone = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, mine)
        per_rank[mode] = everyone
    trainer = bench.trainer
    held = [None] * dist.get_world_size()
    dist.all_gather_object(held, memory_report(trainer.model, trainer.optimizer))  # between updates: no gradients
    plain = statistics.median(checksums["plain"])
    return {
        "checksums": {**{f"{mode}_save_s": median(times) for mode, times in checksums.items()},
                      "hashing_overhead": round(statistics.median(checksums["hashing"]) / plain - 1, 3),
                      "read_back_overhead": round(statistics.median(checksums["read_back"]) / plain - 1, 3)},
        "layout": trainer.ctx.layout,
        "baseline_steps_s": baseline,
        "training_state_bytes_per_rank": held,
        # Times are the same on every rank up to the closing barrier; rank 0's stand for all.
        "sync": {"save_s": per_rank["sync"][0]["save_s"], "load_s": per_rank["sync"][0]["load_s"],
                 "blocked_s": per_rank["sync"][0]["blocked_s"], "stall_s": per_rank["sync"][0]["stall_s"],
                 "save_peak_bytes_per_rank": [r["save_peak_bytes"] for r in per_rank["sync"]],
                 "load_peak_bytes_per_rank": [r["load_peak_bytes"] for r in per_rank["sync"]]},
        "async": {"save_s": per_rank["async"][0]["save_s"], "load_s": per_rank["async"][0]["load_s"],
                  "blocked_s": per_rank["async"][0]["blocked_s"], "stall_s": per_rank["async"][0]["stall_s"],
                  "save_peak_bytes_per_rank": [r["save_peak_bytes"] for r in per_rank["async"]],
                  "load_peak_bytes_per_rank": [r["load_peak_bytes"] for r in per_rank["async"]]},
    }



# ---------------------------------------------------------------------------- --disk-speed
# roberta_large's training state (model + Adam, 4.3 GB) under FSDP on 2 ranks, each rank
# holding and writing half: saved and loaded by dd, by raw DCP and by distlm, interleaved.

PUBLISHED_VOCABULARY = ["--vocab-size", "50265"]
"""roberta_base's and roberta_large's embedding (the synthetic corpus has 40 words)."""
DD_BLOCK = 4 << 20
HASHES = ("crc32", "adler32", "sha1", "sha256", "blake2b", "md5")
TENSOR_STATES = ("model", "optimizer", "rng")
"""The states of a training run that hold tensors: what distlm writes into the shards, and raw DCP saves here."""


def disk_model(args: argparse.Namespace) -> list[str]:
    return ["--arch", args.arch, *(PUBLISHED_VOCABULARY if args.arch in ("roberta_base", "roberta_large") else [])]


def wall(fn) -> float:
    """Seconds from a barrier before ``fn`` (run on every rank) to a barrier after it."""
    dist.barrier()
    start = time.perf_counter()
    fn()
    dist.barrier()
    return time.perf_counter() - start


def drop_page_cache() -> bool:
    """Write dirty pages back and drop the page cache (needs root), so that the next read comes
    from the disk; False where it cannot be dropped (the reads then come from memory)."""
    os.sync()
    try:
        Path("/proc/sys/vm/drop_caches").write_text("3")
    except OSError:
        return False
    return True


def drop_page_cache_everywhere() -> bool:
    """``drop_page_cache`` on rank 0 (one kernel holds every rank's pages here), between barriers."""
    dist.barrier()
    flag = [drop_page_cache() if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(flag, src=0)
    return flag[0]


def dd(*operands: str) -> None:
    subprocess.run(["dd", *operands, "status=none"], check=True)


def tensor_bytes(value) -> int:
    """Bytes of the local tensors in a (nested) state dict: a DTensor counts its own shard."""
    if isinstance(value, dict):
        return sum(tensor_bytes(item) for item in value.values())
    if isinstance(value, DTensor):
        value = value.to_local()
    return value.numel() * value.element_size() if isinstance(value, torch.Tensor) else 0


def measure_hashes(megabytes: int = 256, rounds: int = 3) -> dict[str, float]:
    """GB/s of each candidate checksum over ``megabytes`` of random bytes in memory, one core,
    interleaved; the median of ``rounds``."""
    data = np.random.default_rng(0).integers(0, 256, megabytes << 20, dtype=np.uint8).tobytes()
    hashers = {"crc32": zlib.crc32, "adler32": zlib.adler32,
               **{name: (lambda data, name=name: hashlib.new(name, data).digest()) for name in HASHES[2:]}}
    seconds = {name: [] for name in HASHES}
    for round_index in range(rounds):
        for name in HASHES[round_index % len(HASHES):] + HASHES[:round_index % len(HASHES)]:
            start = time.perf_counter()
            hashers[name](data)
            seconds[name].append(time.perf_counter() - start)
    return {name: round(len(data) / statistics.median(times) / 1e9, 2) for name, times in seconds.items()}


class UncheckedWriter(FileSystemWriter):
    """DCP's file writer with no checksum at all: distlm's save without its CRC-32 (torch.save's
    per-record zip checksum off, as distlm's writer has it). The checksums' cost is a save's
    time over this one's."""

    def write_data(self, plan, planner):
        with integrity.zip_checksums_off():
            return super().write_data(plan, planner)


class DiskSpeed:
    """The contenders of ``--disk-speed`` on one Trainer (roberta_large, FSDP)."""

    def __init__(self, data: Path, scratch: Path, args: argparse.Namespace):
        self.bench = Bench("disk", STRATEGIES["fsdp"], data, scratch / "checkpoints", args, model=disk_model(args))
        self.trainer = self.bench.trainer
        self.args = args
        self.rank = dist.get_rank()
        self.dirs = scratch / "disk"
        self.dirs.mkdir(parents=True, exist_ok=True)
        self.state_bytes = tensor_bytes(self.state())
        self.dd_file = self.dirs / f"dd-rank{self.rank}"

    def state(self) -> dict:
        states = self.trainer.states
        return {key: states[key].state_dict() for key in TENSOR_STATES if key in states}

    def remove(self, *names: str) -> None:
        """Remove scratch checkpoints (rank 0) and write back what is dirty, before a timed save."""
        dist.barrier()
        if self.rank == 0:
            for name in names:
                shutil.rmtree(self.dirs / name, ignore_errors=True)
            os.sync()
        dist.barrier()

    # Writers, each the same bytes per rank (its half of the state).
    def dd_write(self) -> float:
        self.dd_file.unlink(missing_ok=True)
        count = -(-self.state_bytes // DD_BLOCK)
        return wall(lambda: dd("if=/dev/zero", f"of={self.dd_file}", f"bs={DD_BLOCK}", f"count={count}",
                               "oflag=direct"))

    def dcp_save(self, name: str, writer=None) -> float:
        self.remove(name)
        state = self.state()
        writer = writer(self.dirs / name) if writer is not None else None
        return wall(lambda: dcp.save(state, checkpoint_id=self.dirs / name, storage_writer=writer))

    def distlm_save(self) -> float:
        dist.barrier()
        if self.rank == 0:
            os.sync()
        return wall(lambda: self.bench.save("sync"))  # replaces the previous round's checkpoint_last

    # Readers (``cold``: the page cache dropped first).
    def dd_read(self, cold: bool) -> float:
        if cold:
            drop_page_cache_everywhere()
        return wall(lambda: dd(f"if={self.dd_file}", "of=/dev/null", f"bs={DD_BLOCK}", "iflag=direct"))

    def dcp_load(self, cold: bool) -> float:
        state = self.state()
        if cold:
            drop_page_cache_everywhere()
        return wall(lambda: dcp.load(state, checkpoint_id=self.dirs / "dcp"))

    def distlm_load(self, cold: bool, verify: bool = True) -> float:
        checkpointer = self.bench.checkpointers["sync"]
        checkpointer.settings.no_verify_checkpoint = not verify
        if cold:
            drop_page_cache_everywhere()
        trainer = self.trainer
        seconds = wall(lambda: checkpointer.load(checkpointer.find_resume(), trainer.states, trainer.config.seed))
        checkpointer.settings.no_verify_checkpoint = False
        return seconds

    # The training loop's stall on an asynchronous save.
    def step(self) -> float:
        dist.barrier()
        start = time.perf_counter()
        self.bench.step()
        return time.perf_counter() - start

    def stall(self) -> dict[str, float]:
        """``--steps`` updates alone, then an asynchronous save and updates until every rank's
        write is done (at most ``--max-steps-during-save``), then the wait for its commit."""
        baseline = [self.step() for _ in range(self.args.steps)]
        checkpointer = self.bench.checkpointers["async"]
        dist.barrier()
        start = time.perf_counter()
        self.bench.save("async")
        blocked = time.perf_counter() - start
        during = []
        while len(during) < self.args.max_steps_during_save and any_rank(checkpointer.writing):
            during.append(self.step())
        start = time.perf_counter()
        checkpointer.wait()
        dist.barrier()
        waited = time.perf_counter() - start
        step = statistics.median(baseline)
        stall = blocked + sum(during) - step * len(during) + waited
        return {"step_s": step, "blocked_s": blocked, "steps_during_write": len(during),
                "steps_during_write_s": sum(during), "commit_wait_s": waited, "stall_s": stall,
                "stall_per_step": stall / step}


def any_rank(flag: bool) -> bool:
    value = torch.tensor([int(flag)])
    dist.all_reduce(value, op=dist.ReduceOp.MAX)
    return bool(value.item())


def run_disk_speed(scratch: Path, data: Path, args: argparse.Namespace) -> dict:
    speed = DiskSpeed(data, scratch, args)
    gigabytes = speed.state_bytes * dist.get_world_size() / 1e9  # every rank holds an equal half
    writes = {
        "dd_write": speed.dd_write,
        "dcp_save": lambda: speed.dcp_save("dcp"),
        "distlm_save": speed.distlm_save,
        "hashing_save": lambda: speed.dcp_save("hashing", integrity.HashingWriter),
        "unchecked_save": lambda: speed.dcp_save("unchecked", UncheckedWriter),
    }
    reads = {
        "dd_read": lambda: speed.dd_read(True),
        "dcp_load": lambda: speed.dcp_load(True),
        "distlm_load": lambda: speed.distlm_load(True),
        "distlm_load_unverified": lambda: speed.distlm_load(True, verify=False),
        "dcp_load_warm": lambda: speed.dcp_load(False),
        "distlm_load_warm": lambda: speed.distlm_load(False),
    }
    times = {name: [] for name in [*writes, *reads]}
    stalls = []
    cold = drop_page_cache_everywhere()
    for round_index in range(args.rounds):
        for contenders in (writes, reads):
            names = list(contenders)
            shift = round_index % len(names)
            for name in names[shift:] + names[:shift]:
                times[name].append(contenders[name]())
        stalls.append(speed.stall())
    seconds = {name: statistics.median(values) for name, values in times.items()}
    rate = {name: round(gigabytes / value, 3) for name, value in seconds.items()}
    stall = {key: median([s[key] for s in stalls]) for key in stalls[0]}
    ratios = {"save_vs_dd": ("dd_write", "distlm_save"), "save_vs_dcp": ("dcp_save", "distlm_save"),
              "load_vs_dd": ("dd_read", "distlm_load"), "load_vs_dcp": ("dcp_load", "distlm_load"),
              "warm_load_vs_dcp": ("dcp_load_warm", "distlm_load_warm")}
    report = {
        "model": args.arch, "strategy": "fsdp",
        "parameters": sum(int(np.prod(shape)) for shape in _shapes(speed.trainer)),
        "state_bytes": speed.state_bytes * dist.get_world_size(), "cold_reads": cold,
        "seconds": {name: median(values) for name, values in times.items()},
        "gb_per_s": rate,
        # Each ratio is the other's time over distlm's (above 1: distlm faster), of the medians;
        # checksum_cost is a save's time with distlm's checksums over one without, less one.
        **{name: round(seconds[other] / seconds[mine], 3) for name, (other, mine) in ratios.items()},
        "checksum_cost": round(seconds["hashing_save"] / seconds["unchecked_save"] - 1, 3),
        # The same, round by round (each round's contenders ran back to back).
        "round_ratios": {**{name: [round(a / b, 3) for a, b in zip(times[other], times[mine])]
                            for name, (other, mine) in ratios.items()},
                         "checksum_cost": [round(a / b - 1, 3)
                                           for a, b in zip(times["hashing_save"], times["unchecked_save"])]},
        "seconds_per_round": {name: [round(value, 3) for value in values] for name, values in times.items()},
        "async_stall": stall,
        "stall_rounds": [{key: round(value, 3) for key, value in s.items()} for s in stalls],
    }
    for checkpointer in speed.bench.checkpointers.values():
        checkpointer.close()
    speed.dd_file.unlink(missing_ok=True)
    speed = None  # the Trainer and its states freed before the next process needs the memory
    gc.collect()
    ctypes.CDLL("libc.so.6").malloc_trim(0)
    return report


def run_reshard_child(save_dir: Path, args: argparse.Namespace) -> dict:
    """``--reshard-from``: the 2-rank FSDP checkpoint loaded by one process, in a child
    process without the launcher's environment (a world of one)."""
    launcher = {"RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "ROLE_RANK", "MASTER_ADDR",
                "MASTER_PORT", "TORCHELASTIC_RUN_ID", "GROUP_WORLD_SIZE", "ROLE_WORLD_SIZE", "ROLE_NAME",
                "TORCHELASTIC_RESTART_COUNT", "TORCHELASTIC_MAX_RESTARTS", "TORCHELASTIC_USE_AGENT_STORE",
                "TORCH_NCCL_ASYNC_ERROR_HANDLING", "TORCHELASTIC_ERROR_FILE"}
    env = {key: value for key, value in os.environ.items() if key not in launcher}
    command = [sys.executable, __file__, "--reshard-from", str(save_dir), "--data", str(args.scratch / "data-rank0"),
               "--rounds", str(args.rounds), "--tokens-per-sample", str(args.tokens_per_sample), "--arch", args.arch,
               "--dir", str(args.scratch / "reshard")]
    done = subprocess.run(command, env=env, check=True, stdout=subprocess.PIPE, text=True)
    return json.loads(done.stdout)


def reshard_load(args: argparse.Namespace) -> dict:
    """One process (no process group) loads the checkpoint in ``--reshard-from`` (saved by FSDP
    on 2 ranks, each rank's half in its own file): dd reading both files, raw DCP and distlm
    loading model and optimizer, interleaved, each from a dropped page cache."""
    save_dir = Path(args.reshard_from)
    path = save_dir / LAST
    argv = ["--data", args.data, *disk_model(args), "--tokens-per-sample", str(args.tokens_per_sample),
            "--batch-size", "1", "--max-update", "1000000", "--disable-validation", "--device", "cpu",
            "--save-dir", str(Path(args.dir) / "own")]
    trainer = Trainer(parse_args(argv))
    settings = copy.deepcopy(trainer.config.checkpoint)
    settings.save_dir = str(save_dir)
    checkpointer = Checkpointer(settings, trainer.ctx, trainer.arch, trainer.task)
    shards = sorted(path.glob("*.distcp"))
    state = {key: trainer.states[key].state_dict() for key in ("model", "optimizer")}
    contenders = {
        "dd_read": lambda: [dd(f"if={shard}", "of=/dev/null", f"bs={DD_BLOCK}", "iflag=direct") for shard in shards],
        "dcp_load": lambda: dcp.load(state, checkpoint_id=path, no_dist=True),
        "distlm_load": lambda: checkpointer.load(checkpointer.find_resume(), trainer.states, trainer.config.seed),
    }
    times = {name: [] for name in contenders}
    cold = True
    for round_index in range(args.rounds):
        names = list(contenders)
        for name in names[round_index % len(names):] + names[:round_index % len(names)]:
            cold = drop_page_cache() and cold
            start = time.perf_counter()
            contenders[name]()
            times[name].append(time.perf_counter() - start)
    gigabytes = sum(shard.stat().st_size for shard in shards) / 1e9
    seconds = {name: statistics.median(values) for name, values in times.items()}
    return {"shard_bytes": int(gigabytes * 1e9), "state_bytes": tensor_bytes(state), "cold_reads": cold,
            "seconds": {name: median(values) for name, values in times.items()},
            "gb_per_s": {name: round(gigabytes / value, 3) for name, value in seconds.items()},
            "load_vs_dd": round(seconds["dd_read"] / seconds["distlm_load"], 3),
            "load_vs_dcp": round(seconds["dcp_load"] / seconds["distlm_load"], 3)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    default = "zero1-tp2" if world_size >= 4 else "ddp,fsdp,zero1"
    parser.add_argument("--strategies", default=default, help=f"comma-separated, of {', '.join(STRATEGIES)}")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=3, help="updates after each save (the async write overlaps them)")
    parser.add_argument("--global-batch", type=int, default=2)
    parser.add_argument("--tokens-per-sample", type=int, default=64)
    parser.add_argument("--layers", type=int, default=6, help="6: 101M parameters; fewer for a quick try")
    parser.add_argument("--dir", default=None, help="scratch directory for data and checkpoints (removed at the end)")
    parser.add_argument("--disk-speed", action="store_true",
                        help="instead of the strategies: roberta_large under FSDP against dd and raw DCP")
    parser.add_argument("--arch", default="roberta_large",
                        help="--disk-speed: the model (roberta_tiny for a quick try)")
    parser.add_argument("--max-steps-during-save", type=int, default=8,
                        help="--disk-speed: updates at most while an asynchronous save is written")
    parser.add_argument("--reshard-from", default=None, help=argparse.SUPPRESS)  # the child of --disk-speed
    parser.add_argument("--data", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.reshard_from is not None:
        print(json.dumps(reshard_load(args)))
        return

    run_id = os.environ.get("TORCHELASTIC_RUN_ID", "run")
    scratch = Path(args.dir or Path(tempfile.gettempdir()) / f"distlm-bench-checkpoint-{run_id}")
    args.scratch = scratch
    rank = int(os.environ["RANK"])
    write_corpus(scratch / f"data-rank{rank}")  # identical on every rank, written by each
    report = {"benchmark": "checkpoint", "world_size": world_size, "rounds": args.rounds,
              "steps_after_save": args.steps, "strategies": {}}
    if args.disk_speed:
        report = {"benchmark": "checkpoint --disk-speed", "world_size": world_size, "rounds": args.rounds,
                  "cpu": cpu_model(), "date": time.strftime("%Y-%m-%d"), "torch": torch.__version__}
        report.update(run_disk_speed(scratch, scratch / f"data-rank{rank}", args))
    for name in args.strategies.split(",") if not args.disk_speed else []:
        bench = Bench(name, STRATEGIES[name], scratch / f"data-rank{rank}", scratch / "checkpoints", args)
        if "parameters" not in report:
            report["parameters"] = sum(int(np.prod(s)) for s in _shapes(bench.trainer))
        report["strategies"][name] = run(bench, args)
        del bench
        gc.collect()
    dist.barrier()
    dist.destroy_process_group()
    if rank == 0:
        if args.disk_speed:  # one process alone on the machine, the other ranks gone with their memory
            report["hashes_gb_per_s"] = measure_hashes()
            report["reshard_load"] = run_reshard_child(scratch / "checkpoints" / "disk" / "sync", args)
        print(json.dumps(report, indent=2))
        shutil.rmtree(scratch, ignore_errors=True)


def cpu_model() -> dict[str, str]:
    """The processor's model name and the flags that matter to checksums and copies."""
    model, flags = cpu_model_and_flags()
    wanted = ("sse4_2", "pclmulqdq", "vpclmulqdq", "avx2", "avx512f", "avx512bw", "avx512vl", "sha_ni")
    return {"model": model or "?", "flags": " ".join(flag for flag in wanted if flag in flags),
            "cores": str(os.cpu_count())}


def _shapes(trainer: Trainer) -> list[tuple[int, ...]]:
    """Shapes of the single-device parameters (DTensor parameters report their global shape)."""
    return [tuple(p.shape) for p in trainer.model.parameters()]


if __name__ == "__main__":
    main()
    exit_without_teardown(0)  # gloo threads may outlive main(); see its docstring
