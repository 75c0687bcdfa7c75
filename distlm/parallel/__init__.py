"""Parallelism applied from outside to a single-device model (api.py, in a fixed order): pipeline
stages, tensor parallel, per-block compile, activation checkpointing, a mixture of experts'
expert parallel, then FSDP or DDP with its communication hooks; ZeRO-1's sharded optimizer.

Layer: may import distlm's core (errors, choices, layout, mesh, precision, optim),
``distlm.backends``, ``distlm.runtime``, ``distlm.state``, ``distlm.data`` (the ignore index) and
``distlm.models``; never checkpoint, observe or training.
"""
