"""Checkpoints: sharded save and load for any layout, atomic directories, offline reading."""

from distlm.checkpoint.checkpointer import Checkpointer, CheckpointError, Resume, TrainProgress
from distlm.checkpoint.directory import BEST, LAST, TOKENIZER_DIR, epoch_name, numbered
from distlm.checkpoint.reader import CheckpointReader, load, resolve

__all__ = [
    "BEST",
    "CheckpointError",
    "CheckpointReader",
    "Checkpointer",
    "LAST",
    "Resume",
    "TOKENIZER_DIR",
    "TrainProgress",
    "epoch_name",
    "load",
    "numbered",
    "resolve",
]
