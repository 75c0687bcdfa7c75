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
import sys
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence, get_type_hints

from distlm.choices import CHOICES
from distlm.errors import UsageError


@dataclass
class ModelConfig:
    arch: str = "roberta_tiny"
    """Model architecture: roberta_tiny|roberta_base|roberta_large|llama_tiny|llama2_7b|llama3_8b."""
    dropout: float | None = None
    """Dropout probability on residual branches; default: the architecture's own."""
    attention_dropout: float | None = None
    """Dropout probability on attention weights; default: the architecture's own."""


@dataclass
class DataConfig:
    data: str | None = None
    """fairseq-preprocess output directory (dict.txt, train.bin/.idx); default: the built-in corpus."""
    task: str | None = None
    """masked_lm or causal_lm; default: the one the architecture is built for."""
    tokens_per_sample: int = 128
    """Maximum tokens per sample (fairseq --tokens-per-sample)."""
    sample_break_mode: str = "complete"
    """How text is cut into samples: none|complete|eos, as in fairseq."""
    batch_size: int = 16
    """Samples per micro-batch per data-parallel replica (fairseq --max-sentences)."""
    update_freq: int = 1
    """Micro-batches accumulated per update; gradients are synchronised on the last only."""
    mask_prob: float = 0.15
    """Fraction of tokens masked for masked_lm (80% <mask>, 10% random, 10% unchanged)."""
    num_workers: int = 0
    """Data-loading worker processes per rank (0 loads in the training process)."""


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
    max_update: int = 100
    """Stop after this many updates (0: no limit)."""
    max_epoch: int = 0
    """Stop after this many passes over the training data (0: no limit)."""
    clip_norm: float = 1.0
    """Clip the global gradient norm to this value (0: no clipping)."""
    adam_betas: tuple[float, float] = (0.9, 0.98)
    """Adam betas, e.g. '(0.9, 0.98)'."""
    adam_eps: float = 1e-6
    """Adam epsilon."""
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
    """Stop with an error when the loss scale falls below this (the run has diverged)."""


@dataclass
class DistributedConfig:
    device: str = "auto"
    """auto|cpu|cuda|neuron."""
    strategy: str = "ddp"
    """Data-parallel strategy: ddp (replicated), fsdp (FSDP2, fully sharded) or zero1 (optimizer state sharded)."""
    tp_degree: int = 1
    """Tensor-parallel degree: ranks that split each layer; they see the same batch."""
    dp_degree: int = -1
    """Data-parallel degree; default (-1): whatever --tp-degree leaves of the world size."""
    sequence_parallel: bool = False
    """With --tp-degree: also shard norms and dropout regions along the sequence."""
    activation_checkpointing: bool = False
    """Recompute each transformer block's activations in backward instead of storing them."""
    cpu_offload: bool = False
    """FSDP: keep parameters and optimizer state in host memory (needs an accelerator)."""
    ddp_backend: str | None = None
    """fairseq name for the DDP implementation; c10d (or pytorch_ddp) means --strategy ddp."""
    bucket_cap_mb: float = 25.0
    """DDP gradient bucket size in MiB; all-reduce of a full bucket overlaps the rest of backward."""
    comm_hook: str = "allreduce"
    """How each DDP gradient bucket is averaged: allreduce|fp16|bf16|hierarchical|hierarchical-fp16."""
    double_buffering: bool = False
    """ChainerMN double buffering: update t applies update t-1's averaged gradients while t's are in flight."""
    ranks_per_node: int | None = None
    """Ranks per node for the hierarchical hook; default: the launcher's local world size (set it to simulate nodes)."""
    comm_transport: str = "torch"
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
    save_dir: str = "checkpoints"
    """Directory of checkpoints (each a directory of shards); a run resumes from its checkpoint_last."""
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
    no_save: bool = False
    """Neither save nor resume checkpoints."""


@dataclass
class LoggingConfig:
    log_format: str | None = None
    """json|simple|tqdm; default: tqdm on a terminal, json otherwise."""
    log_interval: int = 10
    """Log training statistics every N updates."""


@dataclass
class TrainConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    precision: PrecisionConfig = field(default_factory=PrecisionConfig)
    distributed: DistributedConfig = field(default_factory=DistributedConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
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

# fairseq spells a few settings differently; these names are accepted as aliases.
ALIASES = {"max_sentences": "batch_size"}

# fairseq flags with exactly one meaning that distlm always has: accepted if the value matches.
FAIRSEQ_FIXED_VALUES = {
    "criterion": {"masked_lm": "masked_lm", "cross_entropy": "causal_lm"},
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


class OneLineErrorParser(argparse.ArgumentParser):
    """argparse prints usage plus a message; distlm promises one line and exit status 2."""

    def error(self, message: str) -> None:  # type: ignore[override]
        raise UsageError(message)


def _parse_value(kind: Any, raw: str, flag: str) -> Any:
    """Convert a flag's string to the field's type, with an error naming the flag."""
    kind = str(kind)
    try:
        if "tuple" in kind:
            parsed = ast.literal_eval(raw)
            values = tuple(float(x) for x in (parsed if isinstance(parsed, (tuple, list)) else [parsed]))
            if len(values) != 2:
                raise ValueError
            return values
        if "int" in kind and "float" not in kind:
            return int(raw)
        if "float" in kind:
            return float(raw)
    except (ValueError, SyntaxError):
        raise UsageError(f"{flag}: cannot parse {raw!r} as {kind.replace(' | None', '')}") from None
    return raw


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
        if hints[f.name] is bool:
            group.add_argument(*flags, dest=dest_prefix + f.name, action="store_true", default=None, help=help_text)
            continue
        if f.name in CHOICES:
            help_text += f" Choices: {', '.join(CHOICES[f.name])}."
        if f.default is not None and f.default is not dataclasses.MISSING:
            help_text += f" (default: {f.default})"
        group.add_argument(*flags, dest=dest_prefix + f.name, default=None, metavar=f.name.upper(), help=help_text)


def _apply(config: TrainConfig, section: str | None, name: str, raw: Any, origin: str) -> None:
    target = config if section is None else getattr(config, section)
    hints = get_type_hints(type(target))
    if name not in hints:
        raise UsageError(f"{origin}: unknown setting {name!r}" + (f" in [{section}]" if section else ""))
    value = _parse_value(hints[name], raw, origin) if isinstance(raw, str) else raw
    if isinstance(raw, list) and "tuple" in str(hints[name]):
        value = tuple(float(x) for x in raw)
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
        if isinstance(value, dict):
            if key not in SECTIONS:
                raise UsageError(f"--config {path}: unknown section [{key}]; sections are {', '.join(SECTIONS)}")
            for name, item in value.items():
                _apply(config, key, name, item, f"--config {path}")
        else:
            _apply(config, None, key, value, f"--config {path}")


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
        if flag_data is not None and flag_data != args.data_positional:
            raise UsageError(f"data given twice: positional {args.data_positional!r} and --data {flag_data!r}")
        config.data.data = args.data_positional
    if args.criterion is not None:
        _apply_criterion(config, args.criterion)
    check_settings(config)
    return config


def _apply_criterion(config: TrainConfig, criterion: str) -> None:
    implied = FAIRSEQ_FIXED_VALUES["criterion"].get(criterion)
    if implied is None:
        raise UsageError(f"--criterion {criterion} is not supported; use masked_lm or cross_entropy")
    if config.data.task not in (None, implied):
        raise UsageError(f"--criterion {criterion} does not fit --task {config.data.task}; use --task {implied}")
    config.data.task = implied


def arch_overrides(model: ModelConfig) -> dict[str, Any]:
    """The model settings given on the command line, as overrides of the named arch's config."""
    return {
        name: value
        for name, value in (("dropout", model.dropout), ("attention_dropout", model.attention_dropout))
        if value is not None
    }


def check_settings(config: TrainConfig) -> None:
    """Checks of each setting on its own (no launch, no hardware); each failure names its flag.

    ``distlm.validation.validate`` runs these and the checks that need the launch."""
    for section in SECTIONS:
        for name, allowed in CHOICES.items():
            value = getattr(getattr(config, section), name, None)
            if value is not None and hasattr(getattr(config, section), name) and value not in allowed:
                raise UsageError(f"--{name.replace('_', '-')} {value} is not one of: {', '.join(allowed)}")
    if config.distributed.ddp_backend is not None:
        # fairseq's c10d backend is torch DDP: same strategy under its fairseq name.
        if config.distributed.strategy != "ddp":
            raise UsageError(f"--ddp-backend {config.distributed.ddp_backend} means --strategy ddp, not {config.distributed.strategy}")
    positive = {
        "--tokens-per-sample": config.data.tokens_per_sample,
        "--batch-size": config.data.batch_size,
        "--update-freq": config.data.update_freq,
        "--log-interval": config.logging.log_interval,
        "--save-interval": config.checkpoint.save_interval,
    }
    for flag, value in positive.items():
        if value < 1:
            raise UsageError(f"{flag} must be at least 1, got {value}")
    non_negative = {
        "--max-update": config.optim.max_update,
        "--max-epoch": config.optim.max_epoch,
        "--warmup-updates": config.optim.warmup_updates,
        "--save-interval-updates": config.checkpoint.save_interval_updates,
        "--clip-norm": config.optim.clip_norm,
        "--weight-decay": config.optim.weight_decay,
        "--num-workers": config.data.num_workers,
    }
    for flag, value in non_negative.items():
        if value < 0:
            raise UsageError(f"{flag} must not be negative, got {value}")
    if config.optim.max_update == 0 and config.optim.max_epoch == 0:
        raise UsageError("set --max-update or --max-epoch: with both 0 the run would never stop")
    if not 0.0 < config.data.mask_prob < 1.0:
        raise UsageError(f"--mask-prob must be in (0, 1), got {config.data.mask_prob}")
    if config.optim.lr <= 0:
        raise UsageError(f"--lr must be positive, got {config.optim.lr}")
    for flag, p in (("--dropout", config.model.dropout), ("--attention-dropout", config.model.attention_dropout)):
        if p is not None and not 0.0 <= p < 1.0:
            raise UsageError(f"{flag} must be in [0, 1), got {p}")
    if config.precision.fp16 and config.precision.bf16:
        raise UsageError("--fp16 and --bf16 are exclusive; pick one")
    if config.precision.memory_efficient_fp16 and config.precision.bf16:
        raise UsageError("--memory-efficient-fp16 is an fp16 mode; it cannot be combined with --bf16")
    if config.precision.fp16_init_scale <= 0:
        raise UsageError(f"--fp16-init-scale must be positive, got {config.precision.fp16_init_scale}")
    if config.precision.fp16_scale_window < 1:
        raise UsageError(f"--fp16-scale-window must be at least 1, got {config.precision.fp16_scale_window}")
    if config.precision.min_loss_scale <= 0:
        raise UsageError(f"--min-loss-scale must be positive, got {config.precision.min_loss_scale}")
    if config.distributed.bucket_cap_mb <= 0:
        raise UsageError(f"--bucket-cap-mb must be positive, got {config.distributed.bucket_cap_mb}")
    if config.distributed.ranks_per_node is not None and config.distributed.ranks_per_node < 1:
        raise UsageError(f"--ranks-per-node must be at least 1, got {config.distributed.ranks_per_node}")
    if config.distributed.timeout_sec <= 0:
        raise UsageError(f"--timeout-sec must be positive, got {config.distributed.timeout_sec}")
