"""A parallelised model's state as the single-device model's: parameter names whatever wraps
the model (names.py: DDP, FSDP, compile, activation checkpointing) and whole tensors of a
sharded model (full.py). Checkpoints, exports, replica checks and the strategies share them.

Layer: torch only; it imports nothing of distlm.
"""
