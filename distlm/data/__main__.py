"""``python -m distlm.data``: the built-in corpus's figures (building it on first use)."""

import json
import logging

from distlm.data.corpus import corpus_stats

if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    print(json.dumps(corpus_stats(), indent=2, sort_keys=True))
