"""distlm against fairseq-fixed on fairseq's everyday masked-LM command: model size and loss.

Both run the same command line (``fairseq-train`` replaced by ``python -m distlm.train``)
on the same fairseq-preprocess directory: a 16k-symbol dictionary (15,996 words + fairseq's
4 specials) and text drawn from a first-order Markov chain over those words, so the loss
has something to learn. fairseq is never a dependency: it runs in its own virtual
environment (``--fairseq-venv``, made as the README's fairseq section says).

    python benchmarks/fairseq_roberta.py params --out tests/fixtures/fairseq_roberta_params.json
        builds fairseq's model (one update) and records its printed parameter count with
        the command and version that printed it: the fixture tests/test_models.py compares with.
    python benchmarks/fairseq_roberta.py loss --updates 300
        trains both for 300 updates, one rank each, one after the other, and prints each
        one's training loss at updates 100, 150, ..., 300 and the difference in bits.

Prints one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parent.parent
WORDS = 15_996  # + fairseq's 4 specials: a 16,000-type dictionary, a multiple of fairseq's padding factor 8
MODEL = ("--arch roberta_base --encoder-layers 2 --encoder-embed-dim 128 --encoder-ffn-embed-dim 512 "
         "--encoder-attention-heads 2 --tokens-per-sample 128")
TRAIN = ("--task masked_lm --criterion masked_lm --cpu --sample-break-mode none --batch-size 8 --optimizer adam "
         "--adam-betas (0.9,0.98) --adam-eps 1e-6 --lr 5e-4 --lr-scheduler polynomial_decay --warmup-updates 30 "
         "--total-num-update {updates} --max-update {updates} --dropout 0.1 --attention-dropout 0.1 "
         "--weight-decay 0.01 --clip-norm 0.0 --seed 1 --num-workers 0 --log-format json --log-interval 50 "
         "--disable-validation")


def write_dictionary(path: Path) -> None:
    """fairseq's dict.txt layout, ``symbol count`` per line, most frequent first."""
    path.write_text("".join(f"w{i} {WORDS - i}\n" for i in range(WORDS)))


def write_text(path: Path, lines: int, seed: int) -> None:
    """Lines of a Markov chain: each word is followed by one of 4 successors of its own
    (Zipf-distributed words start a line), so a model can learn the successors."""
    rng = np.random.default_rng(seed)
    successors = np.random.default_rng(0).integers(0, WORDS, size=(WORDS, 4))
    zipf = 1.0 / np.arange(1, WORDS + 1)
    zipf /= zipf.sum()
    out = []
    for _ in range(lines):
        word = rng.choice(WORDS, p=zipf)
        line = [word]
        for _ in range(rng.integers(10, 60)):
            word = successors[word, rng.integers(4)]
            line.append(word)
        out.append(" ".join(f"w{w}" for w in line))
    path.write_text("\n".join(out) + "\n")


def prepare(directory: Path, venv: Path, lines: int) -> Path:
    """A fairseq-preprocess directory (dict.txt, train/valid .bin/.idx), made by fairseq itself."""
    write_dictionary(directory / "dict.txt")
    write_text(directory / "train.txt", lines, seed=1)
    write_text(directory / "valid.txt", max(lines // 20, 10), seed=2)
    out = directory / "bin"
    subprocess.run([str(venv / "bin" / "fairseq-preprocess"), "--only-source", "--srcdict", str(directory / "dict.txt"),
                    "--trainpref", str(directory / "train.txt"), "--validpref", str(directory / "valid.txt"),
                    "--destdir", str(out), "--workers", "1"], check=True, capture_output=True)
    return out


def run_fairseq(venv: Path, data: Path, updates: int, save_dir: Path) -> str:
    command = [str(venv / "bin" / "fairseq-train"), str(data), *MODEL.split(),
               *TRAIN.format(updates=updates).split(), "--save-dir", str(save_dir), "--no-save"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": ""}
    result = subprocess.run(command, check=True, capture_output=True, text=True, env=env)
    return result.stdout + result.stderr


def run_distlm(data: Path, updates: int) -> str:
    command = [sys.executable, "-m", "distlm.train", str(data), *MODEL.split(),
               *TRAIN.format(updates=updates).split(), "--no-save"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    result = subprocess.run(command, check=True, capture_output=True, text=True, env=env)
    return result.stdout + result.stderr


def fairseq_version(venv: Path) -> str:
    code = "import fairseq, torch, sys; print(fairseq.__version__, torch.__version__, sys.version.split()[0])"
    out = subprocess.run([str(venv / "bin" / "python"), "-c", code], check=True, capture_output=True, text=True)
    return out.stdout.strip()


def record_params(args: argparse.Namespace, work: Path) -> dict:
    """fairseq's model for the command, built by one update; bin and ckpt name temporary directories."""
    data = prepare(work, args.fairseq_venv, lines=400)
    log = run_fairseq(args.fairseq_venv, data, updates=1, save_dir=work / "ckpt")
    printed = re.search(r"num\. shared model params: ([\d,]+)", log)
    types = re.search(r"dictionary: (\d+) types", log)
    fairseq, torch_version, python = fairseq_version(args.fairseq_venv).split()
    record = {
        "made_by": "python benchmarks/fairseq_roberta.py params",
        "fairseq": f"fairseq-fixed {fairseq} (torch {torch_version}, Python {python})",
        "dictionary": f"dict.txt of {WORDS} lines 'w<i> <{WORDS} - i>' for i = 0..{WORDS - 1}",
        "preprocess": "fairseq-preprocess --only-source --srcdict dict.txt --trainpref train.txt "
                      "--validpref valid.txt --destdir bin --workers 1",
        "command": f"fairseq-train bin {MODEL} {TRAIN.format(updates=1)} --save-dir ckpt --no-save",
        "printed": printed.group(0),
        "dictionary_types": int(types.group(1)),
        "num_shared_model_params": int(printed.group(1).replace(",", "")),
    }
    if args.out:
        Path(args.out).write_text(json.dumps(record, indent=1) + "\n")
    return record


def train_losses(log: str) -> dict[int, float]:
    """Training loss (bits) by update, from the JSON log lines of either program."""
    losses = {}
    for line in log.splitlines():
        start = line.find("{")
        if start < 0:
            continue
        try:
            record = json.loads(line[start:])
        except json.JSONDecodeError:
            continue
        if not isinstance(record, dict) or "loss" not in record:
            continue
        # fairseq's "update" is the epoch's progress (1.05); its update count is num_updates.
        update = record.get("num_updates", record.get("update"))
        if record.get("kind", "train") == "train" and update is not None:
            losses[int(update)] = float(record["loss"])
    return losses


def compare_losses(args: argparse.Namespace, work: Path) -> dict:
    data = prepare(work, args.fairseq_venv, lines=args.lines)
    fairseq = train_losses(run_fairseq(args.fairseq_venv, data, args.updates, work / "ckpt"))
    distlm = train_losses(run_distlm(data, args.updates))
    rows = [{"update": u, "fairseq": fairseq.get(u), "distlm": distlm.get(u),
             "difference_bits": None if u not in fairseq or u not in distlm else round(distlm[u] - fairseq[u], 3)}
            for u in range(100, args.updates + 1, 50)]
    return {"command": f"{MODEL} {TRAIN.format(updates=args.updates)}", "fairseq": fairseq_version(args.fairseq_venv),
            "rows": rows, "max_abs_difference_bits": max(abs(r["difference_bits"]) for r in rows
                                                         if r["difference_bits"] is not None)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("what", choices=("params", "loss"))
    parser.add_argument("--fairseq-venv", type=Path, default=Path("/work/fairseq-venv"))
    parser.add_argument("--out", help="params: write the record here (the test fixture)")
    parser.add_argument("--updates", type=int, default=300)
    parser.add_argument("--lines", type=int, default=20_000, help="loss: lines of training text")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        result = record_params(args, Path(tmp)) if args.what == "params" else compare_losses(args, Path(tmp))
    print(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
