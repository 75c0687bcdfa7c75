"""Checkpoints: sharded save and load of Stateful objects for any layout, atomic directories, checksums,
one owner per save dir, safe offline reading.

Layer: needs only the bare distributed context (``distlm.runtime``); may import distlm's core
(errors, config, optim), ``distlm.launch``, ``distlm.state`` and the models' torch-free
registry; never the builder, Hugging Face conversion, parallel, observe or training.
"""

from distlm.checkpoint.checkpointer import Checkpointer, CheckpointError, Resume, TrainProgress, training_states
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
    "training_states",
]
