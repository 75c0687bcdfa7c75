"""distlm's masked-LM masking against fairseq's own ``MaskTokensDataset``, sample by sample.

fairseq (fairseq-fixed 0.12.3) draws each sample's mask from its own numpy Generator,
seeded with ``int(hash((seed, epoch, index)) % 1e6)``, in a fixed order of calls.
distlm's ``DynamicMasker.mask_every_position`` makes the same calls in the same order on
the generator it is given, so handed a generator seeded as fairseq seeds it, it must
produce fairseq's inputs and targets exactly (distlm seeds its own runs with
``default_rng([seed, epoch, index])`` instead, so its masks are fairseq's in distribution,
not bit for bit). This benchmark checks that on blocks built as fairseq's masked_lm task builds
them (``<s>``, documents each ending in ``</s>``), then reports how many of the samples
agree bit for bit, and the statistics of both (distlm with its own seeding as well).

Needs fairseq, which distlm never depends on: run it in an environment that has it, with
distlm on the path, e.g. (fairseq 0.12.2 does not import on Python 3.11; fairseq-fixed does)

    PYTHONPATH=. FAIRSEQ_PYTHON/bin/python benchmarks/fairseq_masking.py --samples 2000

Prints one JSON object; exits 1 when any sample differs.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

import numpy as np
import torch

from distlm.data.dictionary import Dictionary
from distlm.data.masking import IGNORE_INDEX, DynamicMasker


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--samples", type=int, default=2000)
    parser.add_argument("--words", type=int, default=40, help="ordinary symbols in the dictionary")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--epoch", type=int, default=1)
    args = parser.parse_args()
    try:
        from fairseq.data import Dictionary as FairseqDictionary
        from fairseq.data import MaskTokensDataset
    except ImportError as err:
        print(f"fairseq_masking.py: error: needs fairseq ({err}); see the module docstring", file=sys.stderr)
        return 2

    with tempfile.TemporaryDirectory() as tmp:
        dict_txt = Path(tmp) / "dict.txt"
        dict_txt.write_text("".join(f"w{i} {1000 - i}\n" for i in range(args.words)))
        fairseq_dictionary = FairseqDictionary.load(str(dict_txt))
        fairseq_mask = fairseq_dictionary.add_symbol("<mask>")
        dictionary = Dictionary.load(dict_txt)
        dictionary.add_symbol("<mask>")
    assert dictionary.symbols == fairseq_dictionary.symbols, "both dictionaries must number symbols alike"
    assert dictionary.mask() == fairseq_mask

    rng = np.random.default_rng(0)
    first, last = fairseq_dictionary.nspecial, len(fairseq_dictionary) - 1  # ordinary words only
    blocks = []
    for _ in range(args.samples):
        documents = [np.append(rng.integers(first, last, size=rng.integers(3, 40)), fairseq_dictionary.eos())
                     for _ in range(rng.integers(1, 4))]
        blocks.append(np.concatenate([[fairseq_dictionary.bos()], *documents]).astype(np.int64))

    class Blocks(torch.utils.data.Dataset):
        sizes = np.array([len(block) for block in blocks])

        def __len__(self):
            return len(blocks)

        def __getitem__(self, index):
            return torch.from_numpy(blocks[index])

    source, target = MaskTokensDataset.apply_mask(
        Blocks(), fairseq_dictionary, pad_idx=fairseq_dictionary.pad(), mask_idx=fairseq_mask,
        seed=args.seed, mask_prob=0.15, leave_unmasked_prob=0.1, random_token_prob=0.1,
    )
    source.set_epoch(args.epoch)
    target.set_epoch(args.epoch)
    masker = DynamicMasker(dictionary, seed=args.seed)

    same = 0
    stats = {"fairseq": [], "distlm, fairseq's generator": [], "distlm, own seeding": []}
    for index, block in enumerate(blocks):
        fairseq_inputs = source[index].numpy()
        fairseq_targets = target[index].numpy()  # fairseq: pad where nothing is predicted
        fairseq_targets = np.where(fairseq_targets == fairseq_dictionary.pad(), IGNORE_INDEX, fairseq_targets)
        fairseq_generator = np.random.default_rng(int(hash((args.seed, args.epoch, index)) % 1e6))
        inputs, targets = masker.mask_every_position(block, fairseq_generator)
        same += bool(np.array_equal(inputs, fairseq_inputs) and np.array_equal(targets, fairseq_targets))
        own_inputs, own_targets = masker(block, epoch=args.epoch, index=index)
        for name, (x, y) in (("fairseq", (fairseq_inputs, fairseq_targets)),
                             ("distlm, fairseq's generator", (inputs, targets)),
                             ("distlm, own seeding", (own_inputs, own_targets))):
            chosen = y != IGNORE_INDEX
            stats[name].append((chosen.sum(), len(block), (x[chosen] == fairseq_mask).sum(),
                                (x[chosen] == y[chosen]).sum(), chosen[0], chosen[block == fairseq_dictionary.eos()].sum(),
                                (block == fairseq_dictionary.eos()).sum()))

    def summary(rows):
        rows = np.array(rows, dtype=float)
        chosen = rows[:, 0].sum()
        return {"chosen_fraction": round(chosen / rows[:, 1].sum(), 4),
                "mask_fraction_of_chosen": round(rows[:, 2].sum() / chosen, 4),
                "unchanged_fraction_of_chosen": round(rows[:, 3].sum() / chosen, 4),
                "bos_chosen_fraction": round(rows[:, 4].mean(), 4),
                "eos_chosen_fraction": round(rows[:, 5].sum() / rows[:, 6].sum(), 4)}

    print(json.dumps({
        "benchmark": "fairseq_masking", "samples": args.samples, "seed": args.seed, "epoch": args.epoch,
        "identical_to_fairseq_with_its_generator": same,
        "statistics": {name: summary(rows) for name, rows in stats.items()},
    }, indent=1))
    return 0 if same == len(blocks) else 1


if __name__ == "__main__":
    sys.exit(main())
