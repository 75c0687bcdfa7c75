"""Data: byte tokenizer, built-in corpus, fairseq/Megatron indexed datasets, masking, sampling.

The built-in corpus lives in ``distlm.data.corpus`` and is not imported here, so that
``python -m distlm.data.corpus`` runs it without runpy's double-import warning.
"""

from distlm.data.blocks import TokenBlockDataset, compute_block_boundaries
from distlm.data.dictionary import Dictionary
from distlm.data.indexed_dataset import MMapIndexedDataset, write_indexed_dataset
from distlm.data.lm_dataset import LMData, load_lm_data
from distlm.data.masking import IGNORE_INDEX, DynamicMasker
from distlm.data.sampler import GlobalBatchSampler
from distlm.data.tokenizer import ByteTokenizer, byte_dictionary

__all__ = [
    "ByteTokenizer",
    "Dictionary",
    "DynamicMasker",
    "GlobalBatchSampler",
    "IGNORE_INDEX",
    "LMData",
    "MMapIndexedDataset",
    "TokenBlockDataset",
    "byte_dictionary",
    "compute_block_boundaries",
    "load_lm_data",
    "write_indexed_dataset",
]
