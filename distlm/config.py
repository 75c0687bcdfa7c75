"""Typed training configuration: defaults < TOML file < command-line flags.

Every field is a dataclass attribute with a docstring right below it; the docstring
is the ``--help`` text. Flag names are the field names with dashes, and keep
fairseq's spelling where the meaning is the same, so a ``fairseq-train`` command line
runs with ``fairseq-train`` replaced by ``python -m distlm.train``.
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import functools
import inspect
import math
import re
import shlex
import sys
import tomllib
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence, get_type_hints

from distlm.choices import CHOICES
from distlm.errors import OneLineErrorParser, UsageError, did_you_mean
from distlm.layout import Layout, PipelineLayout
from distlm.models import registry


@dataclass
class ModelConfig:
    arch: str | None = None
    """Model architecture (a published arch of a family in distlm/models); default roberta_tiny, or with --init-from-hf the
    Hugging Face model's own (a given --arch must then agree with it)."""
    init_from_hf: str | None = None
    """Start from a Hugging Face model directory (config.json + safetensors): its architecture and weights."""
    dropout: float | None = None
    """Dropout probability on residual branches; default: the architecture's own."""
    attention_dropout: float | None = None
    """Dropout probability on attention weights; default: the architecture's own."""
    activation_dropout: float | None = None
    """RoBERTa: dropout after the feed-forward activation (fairseq --activation-dropout)."""
    encoder_layers: int | None = None
    """RoBERTa: number of encoder layers (fairseq --encoder-layers)."""
    encoder_embed_dim: int | None = None
    """RoBERTa: hidden size (fairseq --encoder-embed-dim)."""
    encoder_ffn_embed_dim: int | None = None
    """RoBERTa: feed-forward inner size (fairseq --encoder-ffn-embed-dim)."""
    encoder_attention_heads: int | None = None
    """RoBERTa: attention heads (fairseq --encoder-attention-heads)."""
    decoder_layers: int | None = None
    """Llama: number of decoder layers (fairseq --decoder-layers)."""
    decoder_embed_dim: int | None = None
    """Llama: hidden size (fairseq --decoder-embed-dim)."""
    decoder_ffn_embed_dim: int | None = None
    """Llama: feed-forward (SwiGLU) inner size (fairseq --decoder-ffn-embed-dim)."""
    decoder_attention_heads: int | None = None
    """Llama: query heads (fairseq --decoder-attention-heads)."""
    kv_heads: int | None = None
    """Llama: key/value heads for grouped-query attention; default: the arch's own, or with
    --decoder-attention-heads the same number of heads (no grouping)."""
    head_dim: int | None = None
    """Llama: size of each attention head; default: the width / heads."""
    multiple_of: int | None = None
    """Llama: the derived feed-forward size (without --decoder-ffn-embed-dim) is rounded up to a multiple of this."""
    ffn_dim_multiplier: float | None = None
    """Llama: scales the derived feed-forward size before rounding (Llama 3: 1.3)."""
    norm_eps: float | None = None
    """Epsilon of every norm (RoBERTa's LayerNorms, Llama's RMSNorms); default: the arch's own."""
    rope_theta: float | None = None
    """Llama: base of the rotary frequencies; default: the arch's own (10000, Llama 3: 500000)."""
    rope_scaling: str | None = None
    """Llama: rotary frequency scaling, none or llama3 (Llama 3.1's, set by the --rope-factor,
    --rope-low-freq-factor, --rope-high-freq-factor and --rope-original-max-seq-len); default: the arch's own."""
    rope_factor: float | None = None
    """Llama, --rope-scaling llama3: low frequencies are divided by this (Llama 3.1: 8)."""
    rope_low_freq_factor: float | None = None
    """Llama, --rope-scaling llama3: wavelengths above original length / this are fully scaled (Llama 3.1: 1)."""
    rope_high_freq_factor: float | None = None
    """Llama, --rope-scaling llama3: wavelengths below original length / this are kept (Llama 3.1: 4)."""
    rope_original_max_seq_len: int | None = None
    """Llama, --rope-scaling llama3: the context length before the extension (Llama 3.1: 8192)."""
    tie_word_embeddings: bool | None = None
    """Llama: the output projection is the token embedding (true|false); RoBERTa's always is."""
    max_positions: int | None = None
    """Longest sample the model accepts, in tokens (RoBERTa's learned positions, Llama's rotary tables);
    default: the arch's own, for fairseq's roberta_base/roberta_large from scratch --tokens-per-sample as in fairseq."""
    vocab_size: int | None = None
    """Rows of the token embedding; at least the data's dictionary, the extra rows unused. Default: the data's
    dictionary (dict.txt + <mask> for masked LM, as fairseq), or the published vocabulary with --init-from-hf or
    with data tokenized by a Hugging Face tokenizer that fits it."""
    num_experts: int | None = None
    """Mixture of experts: routed experts in each MoE layer; default: the arch's own."""
    moe_top_k: int | None = None
    """Mixture of experts: experts each token is routed to; default: the arch's own."""
    moe_ffn_dim: int | None = None
    """Mixture of experts: hidden size of each expert's SwiGLU; default: the arch's own."""
    moe_every: int | None = None
    """Mixture of experts: block i is an MoE block when i + 1 is a multiple of this, the others dense;
    default: the arch's own (1: every block)."""
    moe_shared_experts: int | None = None
    """Mixture of experts: experts every token passes through besides its routed ones; default: the arch's own."""
    moe_router: str | None = None
    """Mixture of experts: softmax (Qwen3-MoE, Mixtral) or sigmoid (DeepSeek-V3) router; default: the arch's own."""
    moe_aux_loss_coef: float | None = None
    """Mixture of experts: coefficient of the load-balancing loss (Switch/Mixtral form), 0 for none;
    default: the arch's own."""
    moe_bias_update_rate: float | None = None
    """Mixture of experts: auxiliary-loss-free balancing, each expert's selection bias moves by this after
    every update towards an even load (DeepSeek-V3: 0.001), 0 for none; default: the arch's own."""
    pad_vocab_to_multiple: int = 1
    """Round the vocabulary up to a multiple of this (8 or 64 can speed the output projection); 1 keeps
    fairseq's exact size and parameter count."""


@dataclass
class DataConfig:
    data: str | None = None
    """fairseq-preprocess output directory (dict.txt, train.bin/.idx); default: the built-in corpus.
    Several directories with one vocabulary mix by weight: --data 0.3:A 0.7:B (in TOML a list, ["0.3:A", "0.7:B"])."""
    task: str | None = None
    """masked_lm or causal_lm; default: the one the architecture is built for."""
    tokens_per_sample: int = 128
    """Maximum tokens per sample (fairseq --tokens-per-sample)."""
    sample_break_mode: str = "complete"
    """How text is cut into samples: none|complete|eos, as in fairseq."""
    document_mask: bool = False
    """Causal LM packing (with --sample-break-mode none or complete): a token attends only to earlier tokens of its
    own document (one sequence of the data files), rotary positions restart at each document, and a document's
    first token is not predicted from the previous one (torchtitan's document mask)."""
    batch_size: int = 16
    """Samples per micro-batch per data-parallel replica (fairseq --max-sentences)."""
    update_freq: int = 1
    """Micro-batches accumulated per update; gradients are synchronised on the last only."""
    max_tokens: int | None = None
    """Batch by a token budget, as fairseq: samples of similar length in batches of at most this many tokens
    (rows x longest sample, padding included) and at most --batch-size rows; default: --batch-size samples."""
    required_batch_size_multiple: int = 8
    """With --max-tokens: a batch's rows are a multiple of this where it has more (fairseq's default 8)."""
    skip_invalid_size_inputs_valid_test: bool = False
    """With --max-tokens: leave out (and count in the log) the training samples longer than the budget,
    instead of refusing the run; with --max-tokens-valid the validation samples longer than its budget too."""
    max_tokens_valid: int | None = None
    """Batch validation by a token budget as --max-tokens does training (fairseq --max-tokens-valid), with
    --batch-size-valid as the most rows; default: --max-tokens (none: --batch-size-valid samples a batch)."""
    mask_prob: float = 0.15
    """Fraction of tokens masked for masked_lm (80% <mask>, 10% random, 10% unchanged)."""
    mask_special_tokens: bool = True
    """Masked LM: draw the masked positions from every position, <s> and </s> included, as fairseq does;
    false never masks special tokens."""
    num_workers: int = 0
    """Data-loading worker processes per rank (0 loads in the training process)."""
    valid_subset: str = "valid"
    """Comma-separated splits to validate on, e.g. valid,valid1."""
    disable_validation: bool = False
    """Never validate."""
    validate_interval: int = 1
    """Validate at the end of every N epochs."""
    validate_interval_updates: int = 0
    """Also validate every N updates (0: only at the ends of epochs)."""
    max_valid_steps: int | None = None
    """Validate on at most this many batches per split (default: the whole split)."""
    batch_size_valid: int | None = None
    """Samples per validation batch per data-parallel rank; default: --batch-size."""


# A source of a mixture is WEIGHT:DIR; a plain directory has no such prefix (a slash, if any,
# comes before its first colon).
_WEIGHTED_SOURCE = re.compile(r"^[^/:]*:")


def parse_data_sources(data: str | None) -> list[tuple[float, str]] | None:
    """The ``(weight, directory)`` sources of a mixture ``--data``, weights as given; None for one
    plain directory or the built-in corpus. UsageError for weights that do not parse, are
    negative or sum to zero."""
    if isinstance(data, (list, tuple)):  # a Python config may hold the sources as a list
        data = join_data_sources(data, "--data")
    if data is None or Path(data).is_dir():
        return None
    try:
        items = shlex.split(data)
    except ValueError as exc:
        raise UsageError(f"--data {data!r}: cannot split into WEIGHT:DIR sources ({exc})") from None
    if len(items) == 1 and not _WEIGHTED_SOURCE.match(items[0]):
        return None
    sources = []
    for item in items:
        weight, colon, directory = item.partition(":")
        if not colon or not directory:
            raise UsageError(f"--data source {item!r} is not WEIGHT:DIR; write a mixture as --data 0.3:A 0.7:B")
        try:
            value = float(weight)
        except ValueError:
            value = math.nan
        if not math.isfinite(value):
            raise UsageError(f"--data source {item!r}: weight {weight!r} is not a number; write it as 0.3:{directory}")
        if value < 0:
            raise UsageError(f"--data source {item!r}: weight {weight} is negative; weights must be 0 or more")
        sources.append((value, directory))
    if sum(weight for weight, _ in sources) <= 0:
        raise UsageError(f"--data {data!r}: the weights sum to 0; give at least one source a positive weight")
    return sources


def join_data_sources(items: Sequence[str], where: str) -> str:
    """The one ``--data`` string of a list of sources (the flag's words or a TOML list)."""
    if not items or not all(isinstance(item, str) for item in items):
        raise UsageError(f"{where} = {list(items)!r}; a mixture is a list of \"WEIGHT:DIR\" strings, e.g. [\"0.3:A\", \"0.7:B\"]")
    return items[0] if len(items) == 1 else shlex.join(items)


def valid_subsets(data: DataConfig) -> list[str]:
    """The splits of --valid-subset in order; the first is the one the best checkpoint follows."""
    return [name for name in (part.strip() for part in data.valid_subset.split(",")) if name]


@dataclass
class OptimConfig:
    optimizer: str = "adam"
    """Optimizer; adam means AdamW (decoupled weight decay), as fairseq's adam is."""
    lr: float = 5e-4
    """Peak learning rate."""
    lr_scheduler: str = "polynomial_decay"
    """polynomial_decay|cosine|fixed, each with linear warmup."""
    warmup_updates: int = 50
    """Updates of linear warmup from 0 to --lr."""
    total_num_update: int | None = None
    """Update at which polynomial/cosine decay reaches its end; default: --max-update."""
    end_learning_rate: float = 0.0
    """Learning rate at the end of polynomial decay (and the floor of cosine)."""
    power: float = 1.0
    """Exponent of polynomial decay."""
    max_update: int = 50
    """Stop after this many updates (0: no limit)."""
    max_epoch: int = 0
    """Stop after this many passes over the training data (0: no limit)."""
    clip_norm: float = 1.0
    """Clip the global gradient norm to this value (0: no clipping)."""
    adam_betas: tuple[float, float] = (0.9, 0.98)
    """Adam betas, e.g. '(0.9, 0.98)'."""
    adam_eps: float = 1e-8
    """Adam epsilon (fairseq's default is 1e-8)."""
    weight_decay: float = 0.01
    """Decoupled weight decay."""


@dataclass
class PrecisionConfig:
    fp16: bool = False
    """fp16 autocast with fp32 weights and dynamic loss scaling."""
    bf16: bool = False
    """bf16 autocast with fp32 weights (no loss scaling needed)."""
    memory_efficient_fp16: bool = False
    """With --fp16: keep weights in fp16, with no fp32 copy (fp32 optimizer state only)."""
    fp16_init_scale: float = 128.0
    """Initial loss scale for fp16."""
    fp16_scale_window: int = 256
    """Updates without overflow before the loss scale is doubled."""
    min_loss_scale: float = 1e-4
    """Stop when the fp16 loss scale falls below this (the run has diverged)."""
    fp16_max_skips: int = 20
    """Stop when this many consecutive fp16 updates overflowed (the run has diverged)."""
    allow_slow_fp16: bool = False
    """Run --fp16 on a device whose fp16 arithmetic is far slower than fp32 (a CPU), for tests and debugging."""


@dataclass
class DistributedConfig:
    """Where and how the ranks run; the layout's settings take their defaults from ``distlm.layout.Layout``."""

    device: str = "auto"
    """Hardware: auto picks what is present."""
    cpu: bool = False
    """Same as --device cpu (fairseq --cpu)."""
    strategy: str = Layout.strategy
    """Data-parallel strategy: ddp (replicated), fsdp (FSDP2, fully sharded) or zero1 (optimizer state sharded)."""
    tp_degree: int = Layout.tp_degree
    """Tensor-parallel degree: ranks that split each layer; they see the same batch."""
    dp_degree: int = Layout.dp_degree
    """Data-parallel degree; default (-1): whatever --tp-degree and --pp-degree leave of the world size."""
    pp_degree: int = Layout.pp_degree
    """Pipeline-parallel degree: ranks that each hold a stage (a run of blocks) of the model."""
    ep_degree: int = Layout.ep_degree
    """Expert-parallel degree: ranks, carved out of the data-parallel ones, that split each MoE layer's
    experts between them; tokens travel to their experts' ranks and back (all-to-all)."""
    pp_schedule: str = PipelineLayout.schedule
    """Pipeline schedule: gpipe|1f1b|interleaved-1f1b|zero-bubble|zbv (the last three want --pp-stages-per-rank 2+)."""
    pp_microbatches: int = PipelineLayout.microbatches
    """Pipeline micro-batches each --batch-size batch is split into (0: 2 x --pp-degree); must divide the batch."""
    pp_stages_per_rank: int = PipelineLayout.stages_per_rank
    """Stages each rank holds, for the looped schedules (interleaved-1f1b, zero-bubble, zbv)."""
    pp_split: str | None = PipelineLayout.split
    """Blocks of each stage, e.g. 0:12,12:24 (default: balanced by parameter count)."""
    sequence_parallel: bool = Layout.sequence_parallel
    """With --tp-degree: also shard norms and dropout regions along the sequence."""
    activation_checkpointing: bool = Layout.activation_checkpointing
    """Recompute each transformer block's activations in backward instead of storing them."""
    cpu_offload: bool = Layout.cpu_offload
    """FSDP: keep parameters and optimizer state in host memory (needs an accelerator)."""
    ddp_backend: str | None = None
    """fairseq name for the DDP implementation; c10d (or pytorch_ddp) means --strategy ddp."""
    bucket_cap_mb: float = Layout.bucket_cap_mb
    """DDP gradient bucket size in MiB; all-reduce of a full bucket overlaps the rest of backward."""
    comm_hook: str = Layout.comm_hook
    """How each DDP gradient bucket is averaged: allreduce|fp16|bf16|hierarchical|hierarchical-fp16."""
    double_buffering: bool = Layout.double_buffering
    """ChainerMN double buffering: update t applies update t-1's averaged gradients while t's are in flight."""
    ranks_per_node: int | None = Layout.ranks_per_node
    """Hierarchical hook: simulate nodes of this many consecutive ranks; default: the real nodes."""
    comm_transport: str = Layout.comm_transport
    """Gradient all-reduce transport: torch (the process group: gloo/NCCL) or mpi (mpi4py, under mpiexec)."""
    network: str = "auto"
    """auto|efa|tcp: efa applies the EFA/NCCL preset (CUDA only); auto applies it when an EFA device exists."""
    timeout_sec: float = 300.0
    """A collective that has not completed after this many seconds fails, naming the ranks."""
    check_replicas: bool = False
    """Debug: after every update, check that all data-parallel replicas hold identical parameters."""
    fast_stat_sync: bool = False
    """Accepted for fairseq compatibility: distlm always reduces its statistics in one collective."""
    distributed_world_size: int | None = None
    """fairseq-style explicit launch: total number of ranks (start one process per rank)."""
    distributed_rank: int | None = None
    """fairseq-style explicit launch: this process's rank."""
    distributed_init_method: str | None = None
    """fairseq-style explicit launch: tcp://HOST:PORT of rank 0."""


@dataclass
class CheckpointConfig:
    save_dir: str | None = None
    """Directory of checkpoints (each a directory of shards); a run resumes from its checkpoint_last.
    Default: checkpoints/MODEL, MODEL being the --arch (the --init-from-hf directory's name, or the
    class of a model handed to the Trainer), so that runs of different models never share one."""
    save_interval_updates: int = 0
    """Also save checkpoint_<updates> every N updates (0: never)."""
    save_interval: int = 1
    """Save checkpoint<epoch> at the end of every N epochs."""
    no_epoch_checkpoints: bool = False
    """Save no checkpoint<epoch> at the ends of epochs (checkpoint_last is still saved)."""
    no_last_checkpoints: bool = False
    """Do not save checkpoint_last."""
    keep_interval_updates: int = -1
    """Keep only the newest N checkpoint_<updates> (-1: keep all)."""
    keep_last_epochs: int = -1
    """Keep only the newest N checkpoint<epoch> (-1: keep all)."""
    async_save: bool = False
    """Stage checkpoints in host memory and write them in the background while training goes on."""
    restore_file: str = "checkpoint_last"
    """Checkpoint to resume from: a name inside --save-dir or a path (default: --save-dir's checkpoint_last, if any)."""
    reset_optimizer: bool = False
    """Resume the weights but start the optimizer, loss scaler and update count afresh."""
    reset_lr_scheduler: bool = False
    """Start the learning-rate schedule (warmup included) again from the resumed update."""
    reset_dataloader: bool = False
    """Start the data from the first sample of the first epoch again."""
    reset_meters: bool = False
    """Start the wall-clock meters afresh."""
    finetune_from_model: str | None = None
    """Start from this checkpoint's weights only (when --save-dir holds no checkpoint to resume)."""
    load_partial: bool = False
    """With --finetune-from-model: load the weights whose name and shape the model shares with the checkpoint, list the rest."""
    no_verify_checkpoint: bool = False
    """Do not verify the checksums of a checkpoint's files when resuming from it (said in the log)."""
    no_save: bool = False
    """Neither save nor resume checkpoints."""
    best_checkpoint_metric: str = "loss"
    """Validation metric that picks checkpoint_best."""
    maximize_best_checkpoint_metric: bool = False
    """A larger --best-checkpoint-metric is better."""
    patience: int = -1
    """Stop after this many validations without improvement (-1: never)."""


@dataclass
class CompileConfig:
    compile: bool = False
    """Compile each transformer block (inductor on CPU and CUDA, the neuron backend on Trainium)."""
    compile_cache: str | None = None
    """Directory for compiled artefacts, shared by nodes and reused by the next run."""
    precompile: bool = False
    """Only compile: run enough updates to compile every graph, fill the cache, save nothing, exit."""


@dataclass
class LoggingConfig:
    log_format: str | None = None
    """json|simple|tqdm; default: tqdm on a terminal, json otherwise."""
    log_interval: int = 10
    """Log training statistics every N updates, and at the first update of a run."""
    log_file: str | None = None
    """Also append rank 0's lines to this file: its log lines from the start (launcher, data, model) and the
    records (JSON unless --log-format simple)."""
    tensorboard_logdir: str | None = None
    """Write TensorBoard events here (rank 0); a resumed run continues them (extra: trackers)."""
    wandb_project: str | None = None
    """Log to this Weights & Biases project (WANDB_MODE=offline works offline; extra: trackers)."""
    wandb_run_name: str | None = None
    """The run's name in W&B and MLflow (default: theirs)."""
    mlflow_tracking_uri: str | None = None
    """Log to this MLflow tracking server or store, e.g. file:/path/mlruns (extra: trackers)."""
    tracker_best_effort: bool = False
    """A tracker that cannot start is a warning and the run goes on without it (default: one line, exit 2)."""
    profile_steps: str | None = None
    """A:B: record updates A to B with torch.profiler on every rank (one Chrome trace per rank)."""
    profile_dir: str | None = None
    """Where the profiler traces go (default: SAVE_DIR/profiles)."""
    memory_snapshot: bool = False
    """CUDA: record the allocator's history and dump it at the end of --profile-steps and on out-of-memory."""


@dataclass
class TrainConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    precision: PrecisionConfig = field(default_factory=PrecisionConfig)
    distributed: DistributedConfig = field(default_factory=DistributedConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    compile: CompileConfig = field(default_factory=CompileConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    seed: int = 1
    """Random seed; data order and masking depend on it only, dropout also on the rank."""

    @property
    def precision_mode(self) -> str:
        """fp32 | fp16 | memory_efficient_fp16 | bf16, from the precision flags."""
        if self.precision.memory_efficient_fp16:
            return "memory_efficient_fp16"
        if self.precision.fp16:
            return "fp16"
        if self.precision.bf16:
            return "bf16"
        return "fp32"

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


SECTIONS: dict[str, type] = {
    name: kind for name, kind in get_type_hints(TrainConfig).items() if dataclasses.is_dataclass(kind)
}

DEFAULT_ARCH = "roberta_tiny"

# fairseq spells a few settings differently; these names are accepted as aliases.
ALIASES = {"max_sentences": "batch_size"}

# fairseq flags with exactly one meaning that distlm always has: accepted if the value matches.
FAIRSEQ_FIXED_VALUES = {
    "criterion": {"masked_lm": "masked_lm", "cross_entropy": "causal_lm"},
}

# Allowed ranges: (lowest, highest, lowest allowed, highest allowed); None: unbounded.
# A highest value is where a setting would stop fitting what it is handed to (float32
# arithmetic, a C++ integer, a timedelta), or far beyond any real run.
_AT_LEAST_1 = (1, None, True, True)
_NOT_NEGATIVE = (0, None, True, True)
_POSITIVE = (0, None, False, True)
_PROBABILITY = (0, 1, True, False)
_KEEP = (-1, None, True, True)
# Adam's first step divides the learning rate by 1 - beta1 in float32 (at most 3.4e38):
# 1e30 leaves room for any beta1 up to 1 - 1e-8.
_LEARNING_RATE = (0, 1e30, False, True)
_LAYERS = (1, 4096, True, True)  # published models have under 200; millions hang while the model is built
_WIDTH = (1, 2**20, True, True)  # 64 x the widest published models (16384); 1e21 overflows torch's sizes
_RANKS = (1, 2**31 - 1, True, True)  # torch.distributed counts ranks in a C++ int
BOUNDS: dict[str, tuple] = {
    "tokens_per_sample": _AT_LEAST_1, "batch_size": _AT_LEAST_1, "update_freq": _AT_LEAST_1,
    "max_tokens": _AT_LEAST_1, "max_tokens_valid": _AT_LEAST_1, "required_batch_size_multiple": _AT_LEAST_1,
    "log_interval": _AT_LEAST_1, "save_interval": _AT_LEAST_1, "validate_interval": _AT_LEAST_1,
    "max_valid_steps": _AT_LEAST_1, "batch_size_valid": _AT_LEAST_1, "tp_degree": _AT_LEAST_1,
    "pp_degree": _AT_LEAST_1, "pp_stages_per_rank": _AT_LEAST_1, "pp_microbatches": _NOT_NEGATIVE,
    "ranks_per_node": _AT_LEAST_1, "fp16_scale_window": _AT_LEAST_1, "fp16_max_skips": _AT_LEAST_1,
    "total_num_update": _AT_LEAST_1, "distributed_world_size": _RANKS,
    "encoder_layers": _LAYERS, "encoder_embed_dim": _WIDTH, "encoder_ffn_embed_dim": _WIDTH,
    "encoder_attention_heads": _AT_LEAST_1, "decoder_layers": _LAYERS, "decoder_embed_dim": _WIDTH,
    "decoder_ffn_embed_dim": _WIDTH, "decoder_attention_heads": _AT_LEAST_1, "kv_heads": _AT_LEAST_1,
    "max_positions": (1, 2**24, True, True),  # 16 M; position tables are allocated whole
    "head_dim": _WIDTH, "multiple_of": _WIDTH, "ffn_dim_multiplier": _POSITIVE, "norm_eps": _POSITIVE,
    "rope_theta": _POSITIVE, "rope_factor": _POSITIVE, "rope_low_freq_factor": _POSITIVE,
    "rope_high_freq_factor": _POSITIVE, "rope_original_max_seq_len": _AT_LEAST_1,
    "num_experts": (1, 2**16, True, True), "moe_top_k": _AT_LEAST_1, "moe_ffn_dim": _WIDTH, "moe_every": _LAYERS,
    "moe_shared_experts": (0, 2**16, True, True), "moe_aux_loss_coef": _NOT_NEGATIVE,
    "moe_bias_update_rate": _NOT_NEGATIVE, "ep_degree": _AT_LEAST_1,
    "vocab_size": (1, 2**24, True, True), "pad_vocab_to_multiple": (1, 2**16, True, True),
    "max_update": _NOT_NEGATIVE, "max_epoch": _NOT_NEGATIVE, "warmup_updates": _NOT_NEGATIVE,
    "save_interval_updates": _NOT_NEGATIVE, "validate_interval_updates": _NOT_NEGATIVE,
    "clip_norm": _NOT_NEGATIVE, "weight_decay": _NOT_NEGATIVE,
    "num_workers": (0, 1024, True, True),  # each is a process: a huge count forks until the host gives out
    "end_learning_rate": (0, _LEARNING_RATE[1], True, True),
    "seed": (0, 2**32 - 1, True, True),  # torch.manual_seed(seed * 1000 + ...) must stay below 2**64
    "distributed_rank": (0, 2**31 - 2, True, True),
    "lr": _LEARNING_RATE, "adam_eps": _POSITIVE, "power": _POSITIVE,
    # A scale far above fp16's range only overflows and halves, --fp16-max-skips times, then
    # stops the run; 2**32 reaches fp16's range (65504) in 17 halvings, within the default 20.
    "fp16_init_scale": (0, 2**32, False, True),
    "min_loss_scale": _POSITIVE,
    "bucket_cap_mb": (0, 2**20, False, True),  # 1 TiB; DDP converts the bytes to a C++ int64
    "timeout_sec": (0, 7 * 24 * 3600, False, True),  # a week; far larger overflows datetime.timedelta
    "mask_prob": (0, 1, False, False), "dropout": _PROBABILITY, "attention_dropout": _PROBABILITY,
    "activation_dropout": _PROBABILITY, "adam_betas": _PROBABILITY,
    "keep_interval_updates": _KEEP, "keep_last_epochs": _KEEP, "patience": _KEEP,
}


@functools.cache
def _all_field_docs() -> dict[str, dict[str, str]]:
    """Attribute docstrings of every config class: the string literal right after each field."""
    docs: dict[str, dict[str, str]] = {}
    for node in ast.parse(inspect.getsource(sys.modules[__name__])).body:
        if not isinstance(node, ast.ClassDef):
            continue
        fields = docs.setdefault(node.name, {})
        for item, nxt in zip(node.body, node.body[1:]):
            if (
                isinstance(item, ast.AnnAssign)
                and isinstance(nxt, ast.Expr)
                and isinstance(nxt.value, ast.Constant)
                and isinstance(nxt.value.value, str)
            ):
                fields[item.target.id] = nxt.value.value
    return docs


def _base_type(hint: Any) -> Any:
    """``int`` of ``int | None``; the hint itself otherwise."""
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        return next(arg for arg in typing.get_args(hint) if arg is not type(None))
    return hint


_TRUE, _FALSE = ("true", "yes", "1", "on"), ("false", "no", "0", "off")


def _parse_flag(hint: Any, raw: str, flag: str) -> Any:
    """Convert a flag's string to the field's type, with an error naming the flag."""
    kind = _base_type(hint)
    try:
        if kind is bool:
            if raw.lower() in _TRUE + _FALSE:
                return raw.lower() in _TRUE
            raise ValueError
        if typing.get_origin(kind) is tuple:
            parsed = ast.literal_eval(raw)
            values = tuple(float(x) for x in (parsed if isinstance(parsed, (tuple, list)) else [parsed]))
            if len(values) != 2:
                raise ValueError
            return values
        if kind is int:
            return int(raw)
        if kind is float:
            return float(raw)
    except (ValueError, SyntaxError, TypeError):
        raise UsageError(f"{flag}: cannot parse {raw!r} as {_type_name(kind)}") from None
    return raw


def _check_toml_value(hint: Any, value: Any, where: str) -> Any:
    """A TOML value checked against the field's type: a string is never a bool, a bool never
    an int, a float never an int, a list only where a pair belongs."""
    kind = _base_type(hint)
    if kind is bool:
        ok = isinstance(value, bool)
    elif kind is int:
        ok = isinstance(value, int) and not isinstance(value, bool)
    elif kind is float:
        ok = isinstance(value, (int, float)) and not isinstance(value, bool)
        value = float(value) if ok else value
    elif typing.get_origin(kind) is tuple:
        ok = (isinstance(value, list) and len(value) == 2
              and all(isinstance(x, (int, float)) and not isinstance(x, bool) for x in value))
        value = tuple(float(x) for x in value) if ok else value
    else:
        ok = isinstance(value, str)
    if not ok:
        raise UsageError(f"{where} = {value!r} is a {type(value).__name__}; it must be {_type_name(kind)}")
    return value


def _type_name(kind: Any) -> str:
    if typing.get_origin(kind) is tuple:
        return "a pair of numbers, e.g. (0.9, 0.98)"
    return {bool: "true or false", int: "an integer", float: "a number", str: "a string"}.get(kind, str(kind))


def build_parser() -> argparse.ArgumentParser:
    parser = OneLineErrorParser(
        prog="python -m distlm.train",
        allow_abbrev=False,  # a misspelt fairseq flag must be refused, not matched to a prefix
        description="Train a masked or causal language model on one or many ranks.",
    )
    parser.add_argument("data_positional", nargs="?", metavar="DATA", help="same as --data (fairseq style)")
    parser.add_argument("--config", metavar="FILE.toml", help="TOML file with [model], [data], ... sections")
    parser.add_argument(
        "--criterion", help="fairseq compatibility: masked_lm (with --task masked_lm) or cross_entropy (causal_lm)"
    )
    for section, cls in SECTIONS.items():
        group = parser.add_argument_group(section)
        _add_fields(group, cls, dest_prefix=f"{section}.")
    _add_fields(parser, TrainConfig, dest_prefix="", only=("seed",))
    return parser


def _add_fields(group, cls: type, dest_prefix: str, only: Sequence[str] | None = None) -> None:
    docs = _all_field_docs().get(cls.__name__, {})
    hints = get_type_hints(cls)
    for f in dataclasses.fields(cls):
        if only is not None and f.name not in only:
            continue
        flags = ["--" + f.name.replace("_", "-")]
        flags += ["--" + alias.replace("_", "-") for alias, target in ALIASES.items() if target == f.name]
        help_text = docs.get(f.name, "").replace("%", "%%")  # argparse %-formats help
        if hints[f.name] is bool and not f.default:
            group.add_argument(*flags, dest=dest_prefix + f.name, action="store_const", const="true", default=None,
                               help=help_text)
            continue
        if hints[f.name] is bool:
            # On by default: the flag takes a value, e.g. --mask-special-tokens false.
            group.add_argument(*flags, dest=dest_prefix + f.name, default=None, metavar="true|false",
                               help=help_text + " (default: true)")
            continue
        if f.name in CHOICES:
            help_text += f" Choices: {', '.join(CHOICES[f.name])}."
        if f.default is not None and f.default is not dataclasses.MISSING:
            help_text += f" (default: {f.default})"
        group.add_argument(*flags, dest=dest_prefix + f.name, default=None, metavar=f.name.upper(), help=help_text,
                           nargs="+" if f.name == "data" else None)  # --data 0.3:A 0.7:B


def _apply(config: TrainConfig, section: str | None, name: str, raw: Any, origin: str) -> None:
    """Set one setting from a flag (a string) or a TOML value (typed), checking its type."""
    target = config if section is None else getattr(config, section)
    hints = get_type_hints(type(target))
    if section is None:
        hints = {key: hint for key, hint in hints.items() if key not in SECTIONS}
    if name not in hints:
        where = f" in [{section}]" if section else ""
        raise UsageError(f"{origin}: unknown setting {name!r}{where}{did_you_mean(name, list(hints))}")
    if name == "data" and isinstance(raw, list):
        raw = join_data_sources(raw, f"{origin}: [{section}] {name}" if origin.startswith("--config") else origin)
    if origin.startswith("--config"):
        where = f"{origin}: [{section}] {name}" if section else f"{origin}: {name}"
        value = _check_toml_value(hints[name], raw, where)
    else:
        value = _parse_flag(hints[name], raw, origin)
    setattr(target, name, value)


def load_toml(config: TrainConfig, path: str) -> None:
    file = Path(path)
    if not file.is_file():
        raise UsageError(f"--config {path}: no such file")
    try:
        table = tomllib.loads(file.read_text())
    except tomllib.TOMLDecodeError as exc:
        raise UsageError(f"--config {path}: not valid TOML ({exc})") from None
    for key, value in table.items():
        if key in SECTIONS:
            if not isinstance(value, dict):
                raise UsageError(f"--config {path}: {key} is a section; write its settings under [{key}]")
            for name, item in value.items():
                _apply(config, key, name, item, f"--config {path}")
        elif isinstance(value, dict):
            raise UsageError(f"--config {path}: unknown section [{key}]; sections are {', '.join(SECTIONS)}")
        else:
            section = _section_of(key)
            if section is not None:
                raise UsageError(f"--config {path}: {key} belongs in section [{section}]; move it there")
            _apply(config, None, key, value, f"--config {path}")


def _section_of(name: str) -> str | None:
    return next((section for section, cls in SECTIONS.items() if name in get_type_hints(cls)), None)


def parse_args(argv: Sequence[str] | None = None) -> TrainConfig:
    """Defaults < --config TOML < flags, then validation. Raises UsageError on bad input."""
    parser = build_parser()
    args = parser.parse_args(list(sys.argv[1:] if argv is None else argv))
    config = TrainConfig()
    if args.config:
        load_toml(config, args.config)
    for dest, raw in vars(args).items():
        if raw is None or dest in ("config", "data_positional", "criterion"):
            continue
        section, _, name = dest.rpartition(".")
        flag = "--" + name.replace("_", "-")
        _apply(config, section or None, name, raw, flag)
    if args.data_positional is not None:
        flag_data = getattr(args, "data.data")
        flag_data = None if flag_data is None else join_data_sources(flag_data, "--data")
        if flag_data is not None and flag_data != args.data_positional:
            raise UsageError(f"data given twice: positional {args.data_positional!r} and --data {flag_data!r}")
        config.data.data = args.data_positional
    if args.criterion is not None:
        _apply_criterion(config, args.criterion)
    check_settings(config)
    config.from_command_line = True  # not a field: errors name the flags only (distlm/training/python_api.py)
    return config


def default_save_dir(config: TrainConfig, model_name: str | None = None) -> str:
    """Where a run keeps its checkpoints when --save-dir is not given: checkpoints/MODEL."""
    name = model_name or (Path(config.model.init_from_hf).name if config.model.init_from_hf else config.model.arch)
    return str(Path("checkpoints") / name)


def _apply_criterion(config: TrainConfig, criterion: str) -> None:
    implied = FAIRSEQ_FIXED_VALUES["criterion"].get(criterion)
    if implied is None:
        raise UsageError(f"--criterion {criterion} is not supported; use masked_lm or cross_entropy")
    if config.data.task not in (None, implied):
        raise UsageError(f"--criterion {criterion} does not fit --task {config.data.task}; use --task {implied}")
    config.data.task = implied


def check_settings(config: TrainConfig) -> None:
    """Checks of each setting on its own (no launch, no hardware); each failure names its flag.

    ``distlm.training.validation.validate`` runs these and the checks that need the launch."""
    for section, cls in SECTIONS.items():
        settings = getattr(config, section)
        for name in get_type_hints(cls):
            _check_value(name, getattr(settings, name))
    _check_value("seed", config.seed)
    parse_data_sources(config.data.data)  # a mixture's weights are refused before anything loads
    if config.model.arch is None and config.model.init_from_hf is None:
        config.model.arch = DEFAULT_ARCH
    if config.model.arch is not None:
        # From the torch-free registry, so a mistyped arch or another family's flag is refused at once.
        registry.arch_overrides(config.model)
    if config.distributed.cpu:
        if config.distributed.device not in ("auto", "cpu"):
            raise UsageError(f"--cpu means --device cpu, not --device {config.distributed.device}; drop one")
        config.distributed.device = "cpu"
    if config.distributed.ddp_backend is not None:
        # fairseq's c10d backend is torch DDP: same strategy under its fairseq name.
        if config.distributed.strategy != "ddp":
            raise UsageError(f"--ddp-backend {config.distributed.ddp_backend} means --strategy ddp, not {config.distributed.strategy}")
    if config.distributed.dp_degree != -1 and config.distributed.dp_degree < 1:
        raise UsageError(f"--dp-degree must be at least 1 (or -1: what --tp-degree leaves), got {config.distributed.dp_degree}")
    if config.optim.max_update == 0 and config.optim.max_epoch == 0:
        raise UsageError("set --max-update or --max-epoch: with both 0 the run would never stop")
    if config.precision.fp16 and config.precision.bf16:
        raise UsageError("--fp16 and --bf16 are exclusive; pick one")
    if config.precision.memory_efficient_fp16 and config.precision.bf16:
        raise UsageError("--memory-efficient-fp16 is an fp16 mode; it cannot be combined with --bf16")
    if config.checkpoint.finetune_from_model and config.checkpoint.restore_file != "checkpoint_last":
        raise UsageError("--finetune-from-model and --restore-file both name a starting checkpoint; give one")
    if config.checkpoint.load_partial and not config.checkpoint.finetune_from_model:
        raise UsageError("--load-partial applies to --finetune-from-model only; name the checkpoint to take weights from")
    masked_task = config.data.task is not None and not registry.task_of(config.data.task).attends_causally
    if config.data.document_mask and masked_task:
        raise UsageError("--document-mask is for causal_lm packing; a masked LM attends both ways, drop it")
    if config.data.document_mask and config.data.sample_break_mode == "eos":
        raise UsageError("--document-mask with --sample-break-mode eos masks nothing (one document per block); "
                         "use --sample-break-mode none or complete to pack documents")
    if config.data.skip_invalid_size_inputs_valid_test and config.data.max_tokens is None and \
            config.data.max_tokens_valid is None:
        raise UsageError("--skip-invalid-size-inputs-valid-test skips samples longer than --max-tokens; "
                         "without --max-tokens no sample is too long: drop it or set --max-tokens")
    if config.compile.precompile and not config.compile.compile:
        config.compile.compile = True  # precompiling is compiling


def check_shared_settings(values: dict[str, Any]) -> None:
    """distlm.train's check of each setting on its own (choices, finite, bounds), for a tool whose
    flags keep distlm.train's names and meanings (distlm.plan); its other flags are its own to check."""
    settings = {name for cls in SECTIONS.values() for name in get_type_hints(cls)} | {"seed"}
    for name, value in values.items():
        if name in settings:
            _check_value(name, value)


def _check_value(name: str, value: Any) -> None:
    flag = "--" + name.replace("_", "-")
    if name in CHOICES and value is not None and value not in CHOICES[name]:
        raise UsageError(f"{flag} {value} is not one of: {', '.join(CHOICES[name])}")
    if value is None or isinstance(value, (bool, str)):
        return
    for item in value if isinstance(value, tuple) else (value,):
        if isinstance(item, float) and not math.isfinite(item):
            raise UsageError(f"{flag} must be a finite number, got {item}")
        bounds = BOUNDS.get(name)
        if bounds is None:
            continue
        low, high, low_ok, high_ok = bounds
        below = low is not None and (item < low or (item == low and not low_ok))
        above = high is not None and (item > high or (item == high and not high_ok))
        if below or above:
            raise UsageError(f"{flag} must be {_describe(bounds)}, got {item}")


def _describe(bounds: tuple) -> str:
    low, high, low_ok, high_ok = bounds
    if high is None:
        return f"at least {low}" if low_ok else f"greater than {low}"
    return f"in {'[' if low_ok else '('}{low}, {high}{']' if high_ok else ')'}"
