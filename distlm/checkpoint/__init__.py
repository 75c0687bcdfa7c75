"""Checkpoints: sharded save and load of Stateful objects for any layout, atomic directories, checksums,
one owner per save dir, safe offline reading.

Layer: needs only the bare distributed context (``distlm.runtime``); may import distlm's core
(errors, config, optim), ``distlm.launch``, ``distlm.state`` and the models' torch-free
registry; never the builder, Hugging Face conversion, parallel, observe or training.
"""

from distlm.checkpoint.checkpointer import Checkpointer
from distlm.checkpoint.directory import BEST, LAST, TOKENIZER_DIR, epoch_name, numbered
from distlm.checkpoint.failures import CheckpointError
from distlm.checkpoint.reader import CheckpointReader, load, resolve
from distlm.checkpoint.resume import Resume
from distlm.checkpoint.stateful import TrainProgress, seed_dropout, training_states

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
    "seed_dropout",
    "training_states",
]
