"""Every set of allowed values, declared once.

The command line (``--help`` and its checks), the TOML loader, ``validate`` and the code
that acts on a value all read these tuples, so a new choice is added in one place.
Nothing here imports torch: the command line parses before anything heavy loads.
"""

from __future__ import annotations

from typing import NamedTuple

TASKS = ("masked_lm", "causal_lm")
"""Training objectives; each model declares one as its ``task``."""

SAMPLE_BREAK_MODES = ("none", "complete", "eos")
"""How a token stream is cut into samples, as fairseq's ``--sample-break-mode``."""

TOKENIZER_MODELS = ("bpe", "unigram")
"""The byte-level tokenizers ``distlm.prepare`` trains on raw text (``--tokenizer-model``)."""

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

PROFILE_DEVICE_TYPES = ("cpu", "cuda", "neuron")
"""The device types a cluster profile of the planner describes (trn1's torch-xla runs are
planned as neuron: the same NeuronCores)."""

NETWORKS = ("auto", "efa", "tcp")

class CommHook(NamedTuple):
    """What a ``--comm-hook`` is: its shape and what it sends."""

    hierarchical: bool
    """Reduce inside each node first, then between the nodes' leaders (or one flat all-reduce)."""
    wire_dtype: str | None
    """The half type gradients are rounded to on the wire (between nodes only, for a
    hierarchical hook), by its name in ``precision.DTYPES``; None sends the gradients' own dtype."""


COMM_HOOK_KINDS: dict[str, CommHook] = {
    "allreduce": CommHook(hierarchical=False, wire_dtype=None),
    "fp16": CommHook(hierarchical=False, wire_dtype="fp16"),
    "bf16": CommHook(hierarchical=False, wire_dtype="bf16"),
    "hierarchical": CommHook(hierarchical=True, wire_dtype=None),
    "hierarchical-fp16": CommHook(hierarchical=True, wire_dtype="fp16"),
}
"""Each gradient reduction algorithm of ``--comm-hook`` (parallel/comm_hooks.py) and its kind.
The reducers, the planner's cost and parity's tolerance all read the kind here."""

COMM_HOOKS = tuple(COMM_HOOK_KINDS)
"""The names of ``--comm-hook``."""

COMM_TRANSPORTS = ("torch", "mpi")

COLLECTIVES = ("all_reduce", "all_gather", "reduce_scatter")
"""The collectives a data-parallel update runs, which the planner models and the suite
times (the plain all-reduce, then FSDP's two)."""

PROBE_METHODS = {"all_reduce": "plain", "all_gather": "all_gather", "reduce_scatter": "reduce_scatter"}
"""Each collective's ``method`` name in the suite's collective probe (JSON): the all-reduce is
``plain``, as ``benchmarks/allreduce.py`` reports DDP's averaging all-reduce beside its hooks."""
COLLECTIVE_OF_PROBE_METHOD = {method: kind for kind, method in PROBE_METHODS.items()}

PP_SCHEDULES = ("gpipe", "1f1b", "interleaved-1f1b", "zero-bubble", "zbv")
"""Pipeline schedules of ``--pp-schedule`` (torch.distributed.pipelining); the last three
run ``--pp-stages-per-rank`` > 1 stages on each rank."""

PP_LOOPED_SCHEDULES = ("interleaved-1f1b", "zero-bubble", "zbv")
"""The schedules that run ``--pp-stages-per-rank`` > 1 stages on each rank."""

PP_ZERO_BUBBLE_SCHEDULES = ("zero-bubble", "zbv")
"""The schedules that split backward into its input and weight parts."""


LOG_FORMATS = ("json", "simple", "tqdm")

BEST_CHECKPOINT_METRICS = ("loss", "ppl")

ROPE_SCALINGS = ("none", "llama3")
"""``--rope-scaling``: plain rotary frequencies, or Llama 3.1's scaling (the model's rope_type llama3)."""

MOE_ROUTERS = ("softmax", "sigmoid")
"""``--moe-router``: softmax over the experts with the top-k weights renormalised (Qwen3-MoE,
Mixtral), or sigmoid scores chosen with a balancing bias (DeepSeek-V3)."""

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
    "rope_scaling": ROPE_SCALINGS,
    "moe_router": MOE_ROUTERS,
}
"""Config field name -> its allowed values."""
