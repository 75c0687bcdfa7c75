"""Data: byte and Hugging Face tokenizers, built-in corpus, fairseq/Megatron indexed datasets, masking, sampling.

``python -m distlm.data`` prints the built-in corpus's figures. ``distlm.data.prepare`` is
not imported here, so ``python -m distlm.data.prepare`` (text to training data) runs
without runpy's double-import warning.

Layer: may import distlm's core (errors, choices, config) and ``distlm.runtime`` (data
workers ignore the stop signals); never models, parallel, checkpoint or training.
"""

from distlm.data.blocks import TokenBlockDataset, compute_block_boundaries
from distlm.data.dictionary import Dictionary, Vocabulary
from distlm.data.hf_tokenizer import HFVocabulary, save_tokenizer
from distlm.data.indexed_dataset import MMapIndexedDataset, write_indexed_dataset
from distlm.data.lm_dataset import LMData, MixtureData, SharedScan, load_lm_data, load_split, load_vocabulary
from distlm.data.masking import IGNORE_INDEX, DynamicMasker
from distlm.data.sampler import GlobalBatchSampler
from distlm.data.tokenizer import ByteTokenizer, byte_dictionary, write_hf_tokenizer

__all__ = [
    "ByteTokenizer",
    "Dictionary",
    "DynamicMasker",
    "GlobalBatchSampler",
    "HFVocabulary",
    "IGNORE_INDEX",
    "LMData",
    "MMapIndexedDataset",
    "MixtureData",
    "SharedScan",
    "TokenBlockDataset",
    "Vocabulary",
    "byte_dictionary",
    "compute_block_boundaries",
    "load_lm_data",
    "load_vocabulary",
    "save_tokenizer",
    "write_hf_tokenizer",
    "write_indexed_dataset",
]
