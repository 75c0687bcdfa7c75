"""How fast ``python -m distlm.prepare`` turns JSON lines (or Parquet) into training data,
beside the ceiling: the ``tokenizers`` library's own ``encode_batch`` on the same documents,
already in memory, with nothing read, parsed or written.

    python benchmarks/prepare_speed.py --mb 100 --files 8 --workers 1 2 --rounds 2
    python benchmarks/prepare_speed.py --mb 100 --format parquet   # needs pip install 'distlm[data]'

The corpus is generated: the standard library's prose paragraphs (the built-in corpus's
source), repeated with each copy's words shuffled within its paragraphs until it holds
``--mb`` MB of text, written as ``--files`` shards in a scratch directory. A 16,000-token
byte-level BPE tokenizer is trained on one copy first (not timed). Then, ``--rounds`` times
in an order rotated round by round, the ceiling and one ``prepare`` per ``--workers`` value
(into a fresh directory each, with the progress bar off). The rate is MB of document text
(UTF-8, without the JSON or Parquet around it) per second of wall time, and tokens per second
(without the eos prepare appends), of the median round. Prints one JSON object, with the
machine's load average when the runs ended: the machine is shared, so compare figures of one
run, not across runs.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path


def generate_corpus(directory: Path, megabytes: float, files: int, file_format: str, seed: int) -> tuple[list, int]:
    """Shards of JSON lines (or Parquet) holding about ``megabytes`` MB of text; their paths
    and the text's size in bytes."""
    from distlm.data import corpus

    paragraphs = [text for _, text in corpus.iter_stdlib_paragraphs() if corpus.looks_like_prose(text)]
    rng = random.Random(seed)
    target = int(megabytes * 1e6)
    shards: list[list[str]] = [[] for _ in range(files)]
    size, copy = 0, 0
    while size < target:
        for number, paragraph in enumerate(paragraphs):
            words = paragraph.split(" ")
            if copy:  # the first copy is the real prose; later ones shuffle it, so it is not one text repeated
                rng.shuffle(words)
            text = " ".join(words)
            shards[(copy * len(paragraphs) + number) % files].append(text)
            size += len(text.encode("utf-8"))
            if size >= target:
                break
        copy += 1
    paths = []
    for number, texts in enumerate(shards):
        if file_format == "parquet":
            import pyarrow
            import pyarrow.parquet

            path = directory / f"shard{number:03d}.parquet"
            pyarrow.parquet.write_table(pyarrow.table({"text": texts}), path)
        else:
            path = directory / f"shard{number:03d}.jsonl"
            with open(path, "w", encoding="utf-8") as handle:
                for text in texts:
                    handle.write(json.dumps({"text": text}) + "\n")
        paths.append(path)
    return paths, size


def ceiling(tokenizer_dir: Path, paths: list[Path]) -> tuple[float, int]:
    """Seconds and tokens of tokenizers' encode_batch over every document, read beforehand."""
    from distlm.data.prepare import ENCODE_BATCH, _load_tokenizer, all_documents

    tokenizer, _, _ = _load_tokenizer(tokenizer_dir)
    documents = list(all_documents(paths, None))
    tokens = 0
    started = time.perf_counter()
    for start in range(0, len(documents), ENCODE_BATCH):
        for encoding in tokenizer.encode_batch(documents[start:start + ENCODE_BATCH], add_special_tokens=False):
            tokens += len(encoding.ids)
    return time.perf_counter() - started, tokens


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mb", type=float, default=100, help="MB of text to generate (default 100)")
    parser.add_argument("--files", type=int, default=8, help="shards to write it into (default 8)")
    parser.add_argument("--workers", type=int, nargs="+", default=[1, 2], help="--workers values to time")
    parser.add_argument("--format", choices=("jsonl", "parquet"), default="jsonl", help="the shards' format")
    parser.add_argument("--rounds", type=int, default=2, help="runs of each, interleaved (default 2)")
    parser.add_argument("--seed", type=int, default=1, help="seed of the word shuffles (default 1)")
    parser.add_argument("--work-dir", help="scratch directory (default: a temporary one, removed at the end)")
    args = parser.parse_args()

    from distlm.data import corpus
    from distlm.data.hf_tokenizer import train_tokenizer
    from distlm.data.prepare import prepare

    with tempfile.TemporaryDirectory(prefix="distlm-prepare-speed-", dir=args.work_dir) as scratch:
        root = Path(scratch)
        (root / "corpus").mkdir()
        started = time.perf_counter()
        paths, text_bytes = generate_corpus(root / "corpus", args.mb, args.files, args.format, args.seed)
        generated_s = time.perf_counter() - started
        prose = (text for _, text in corpus.iter_stdlib_paragraphs() if corpus.looks_like_prose(text))
        train_tokenizer(prose, root / "tokenizer", "bpe", 16000)

        report: dict = {
            "text_mb": round(text_bytes / 1e6, 1),
            "input_mb": round(sum(path.stat().st_size for path in paths) / 1e6, 1),
            "files": len(paths),
            "format": args.format,
            "generate_s": round(generated_s, 1),
            "cpu_count": os.cpu_count(),
        }
        runs = ["tokenizers_encode_batch"] + [f"prepare_workers_{workers}" for workers in args.workers]
        times: dict[str, list[float]] = {run: [] for run in runs}
        tokens: dict[str, int] = {}
        for round_index in range(args.rounds):
            shift = round_index % len(runs)
            for run in runs[shift:] + runs[:shift]:
                if run == "tokenizers_encode_batch":
                    seconds, tokens[run] = ceiling(root / "tokenizer", paths)
                else:
                    workers = int(run.rsplit("_", 1)[1])
                    stats = prepare(root / "tokenizer", paths, root / f"out{workers}", valid_fraction=0.001,
                                    progress=False, workers=workers)
                    seconds, tokens[run] = stats["seconds"], stats["tokens"] - stats["documents"]  # less the eos
                times[run].append(seconds)
        for run in runs:
            seconds = statistics.median(times[run])
            report[run] = {"seconds": [round(value, 1) for value in times[run]],
                           "mb_per_s": round(text_bytes / 1e6 / seconds, 2), "tokens_per_s": round(tokens[run] / seconds)}
            report[run]["of_ceiling"] = round(report[run]["mb_per_s"] / report[runs[0]]["mb_per_s"], 2)
        report["load_average_1min"] = round(os.getloadavg()[0], 2)
        report["date"] = time.strftime("%Y-%m-%d")
    json.dump(report, sys.stdout, indent=1)
    print()


if __name__ == "__main__":
    main()
