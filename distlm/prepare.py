"""``python -m distlm.prepare --input FILE ... --out DIR``: raw text to training data in one command.

Without ``--tokenizer HF_DIR`` it trains a byte-level BPE (or ``--tokenizer-model unigram``)
tokenizer on the text and writes it beside the data, which ``--data DIR`` then trains on;
checkpoints and ``python -m distlm.export --hf`` carry that tokenizer, so
``transformers.AutoTokenizer`` loads the export. Inputs are plain text, JSON lines or
Parquet (``--text-key``), read by ``--workers`` processes. The work is distlm/data/prepare.py's
(``python -m distlm.data.prepare`` is the same command).
"""

from __future__ import annotations

import sys
from collections.abc import Sequence

from distlm.data import prepare as data_prepare


def main(argv: Sequence[str] | None = None) -> int:
    return data_prepare.main(argv, prog="python -m distlm.prepare")


if __name__ == "__main__":
    sys.exit(main())
