"""Every set of allowed values, declared once.

The command line (``--help`` and its checks), the TOML loader, ``validate`` and the code
that acts on a value all read these tuples, so a new choice is added in one place.
Nothing here imports torch: the command line parses before anything heavy loads.
"""

from __future__ import annotations

TASKS = ("masked_lm", "causal_lm")
"""Training objectives; each model declares one as its ``task``."""

SAMPLE_BREAK_MODES = ("none", "complete", "eos")
"""How a token stream is cut into samples, as fairseq's ``--sample-break-mode``."""

OPTIMIZERS = ("adam", "adamw")
"""Both mean AdamW (decoupled weight decay), as fairseq's ``adam`` is."""

LR_SCHEDULERS = ("polynomial_decay", "cosine", "fixed")

DEVICES = ("auto", "cpu", "cuda", "neuron", "xla")
"""``auto`` picks the hardware present; the others name a backend in distlm/backends
(``neuron`` is TorchNeuron, ``xla`` any torch-xla PJRT device such as trn1)."""

PRECISIONS = ("fp32", "fp16", "bf16", "memory_efficient_fp16")

STRATEGIES = ("ddp", "zero1", "fsdp")
"""How the data-parallel axis holds the model: replicas, replicas with sharded
optimizer state, or everything sharded."""

DDP_BACKENDS = ("c10d", "pytorch_ddp")
"""fairseq's names for torch DDP (both mean ``--strategy ddp``)."""

NETWORKS = ("auto", "efa", "tcp")

COMM_HOOKS = ("allreduce", "fp16", "bf16", "hierarchical", "hierarchical-fp16")
"""Gradient reduction algorithms of ``--comm-hook`` (parallel/comm_hooks.py)."""

COMM_TRANSPORTS = ("torch", "mpi")

PP_SCHEDULES = ("gpipe", "1f1b", "interleaved-1f1b", "zero-bubble", "zbv")
"""Pipeline schedules of ``--pp-schedule`` (torch.distributed.pipelining); the last three
run ``--pp-stages-per-rank`` > 1 stages on each rank."""

LOG_FORMATS = ("json", "simple", "tqdm")

BEST_CHECKPOINT_METRICS = ("loss", "ppl")

CHOICES: dict[str, tuple[str, ...]] = {
    "task": TASKS,
    "sample_break_mode": SAMPLE_BREAK_MODES,
    "optimizer": OPTIMIZERS,
    "lr_scheduler": LR_SCHEDULERS,
    "device": DEVICES,
    "strategy": STRATEGIES,
    "ddp_backend": DDP_BACKENDS,
    "network": NETWORKS,
    "comm_hook": COMM_HOOKS,
    "comm_transport": COMM_TRANSPORTS,
    "pp_schedule": PP_SCHEDULES,
    "log_format": LOG_FORMATS,
    "best_checkpoint_metric": BEST_CHECKPOINT_METRICS,
}
"""Config field name -> its allowed values."""
