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
"""

from __future__ import annotations

import argparse
import copy
import ctypes
import gc
import json
import os
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.filesystem import FileSystemWriter

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

    def __init__(self, name: str, flags: list[str], data: Path, save_dir: Path, args: argparse.Namespace):
        world_size = int(os.environ["WORLD_SIZE"])
        tp = int(flags[flags.index("--tp-degree") + 1]) if "--tp-degree" in flags else 1
        batch = max(1, args.global_batch // ParallelDims(world_size=world_size, tp=tp).dp)
        argv = [
            "--data", str(data), *MODEL, "--decoder-layers", str(args.layers), *flags, "--tokens-per-sample", str(args.tokens_per_sample),
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    world_size = int(os.environ["WORLD_SIZE"])
    default = "zero1-tp2" if world_size >= 4 else "ddp,fsdp,zero1"
    parser.add_argument("--strategies", default=default, help=f"comma-separated, of {', '.join(STRATEGIES)}")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=3, help="updates after each save (the async write overlaps them)")
    parser.add_argument("--global-batch", type=int, default=2)
    parser.add_argument("--tokens-per-sample", type=int, default=64)
    parser.add_argument("--layers", type=int, default=6, help="6: 101M parameters; fewer for a quick try")
    parser.add_argument("--dir", default=None, help="scratch directory for data and checkpoints (removed at the end)")
    args = parser.parse_args()

    run_id = os.environ.get("TORCHELASTIC_RUN_ID", "run")
    scratch = Path(args.dir or Path(tempfile.gettempdir()) / f"distlm-bench-checkpoint-{run_id}")
    args.scratch = scratch
    rank = int(os.environ["RANK"])
    write_corpus(scratch / f"data-rank{rank}")  # identical on every rank, written by each
    report = {"benchmark": "checkpoint", "world_size": world_size, "rounds": args.rounds,
              "steps_after_save": args.steps, "strategies": {}}
    for name in args.strategies.split(","):
        bench = Bench(name, STRATEGIES[name], scratch / f"data-rank{rank}", scratch / "checkpoints", args)
        if "parameters" not in report:
            report["parameters"] = sum(int(np.prod(s)) for s in _shapes(bench.trainer))
        report["strategies"][name] = run(bench, args)
        del bench
        gc.collect()
    if rank == 0:
        print(json.dumps(report, indent=2))
    dist.barrier()
    if rank == 0:
        shutil.rmtree(scratch, ignore_errors=True)
    dist.barrier()
    dist.destroy_process_group()


def _shapes(trainer: Trainer) -> list[tuple[int, ...]]:
    """Shapes of the single-device parameters (DTensor parameters report their global shape)."""
    return [tuple(p.shape) for p in trainer.model.parameters()]


if __name__ == "__main__":
    main()
    exit_without_teardown(0)  # gloo threads may outlive main(); see its docstring
