"""The load-time check for token ids outside the vocabulary is shared: each rank reads its
part of the .bin, and every rank raises the same one line naming the file's first bad id."""

from __future__ import annotations

import numpy as np

from distributed import run_distributed
from distlm.config import parse_args
from distlm.data import MMapIndexedDataset, write_indexed_dataset
from distlm.errors import UsageError
from distlm.training.trainer import Trainer


def write_data(root, bad_sentences: list[int]) -> None:
    rng = np.random.default_rng(0)
    (root / "dict.txt").write_text("".join(f"w{i} 1\n" for i in range(40)))  # ids 0-3 special, 4-43 words
    sentences = [np.append(rng.integers(4, 44, size=20), 2) for _ in range(300)]
    for index in bad_sentences:
        sentences[index][5] = 44 + index  # past the last symbol
    write_indexed_dataset(str(root / "train"), sentences, np.uint16)
    write_indexed_dataset(str(root / "valid"), sentences[:10], np.uint16)


def test_each_part_reports_only_its_own_ids(tmp_path):
    write_data(tmp_path, [10, 299])
    tokens = MMapIndexedDataset(tmp_path / "train")
    assert tokens.find_id_outside(0, 44) == (54, 10)
    assert tokens.find_id_outside(0, 44, part=(0, 2)) == (54, 10)
    assert tokens.find_id_outside(0, 44, part=(1, 2)) == (343, 299)
    assert tokens.find_id_outside(0, 44, part=(1, 3)) is None


def error_of_start(args: list[str]) -> str:
    try:
        Trainer(parse_args(args))
    except UsageError as err:
        return str(err)
    return "started"


def test_every_rank_raises_the_files_first_bad_id_having_read_its_part(tmp_path):
    write_data(tmp_path, [10, 299])  # one in rank 0's half, one in rank 1's
    args = ["--data", str(tmp_path), "--arch", "llama_tiny", "--tokens-per-sample", "32", "--batch-size", "2",
            "--no-save", "--device", "cpu"]
    expected = (f"data {tmp_path}/train holds token id 54 (in sequence 10) outside the dictionary's 44 symbols; "
                "the vocabulary (dict.txt or tokenizer.json) and the .bin files do not belong together")
    assert run_distributed(error_of_start, 2, args) == [expected, expected]
    write_data(tmp_path, [299])  # only rank 1 reads it
    assert run_distributed(error_of_start, 2, args) == [expected.replace("54 (in sequence 10)", "343 (in sequence 299)")] * 2
