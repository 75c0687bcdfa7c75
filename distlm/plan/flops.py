"""Model FLOPs per token, exact parameter counts, and the peak FLOP/s of each device.

FLOPs are counted as torchtitan counts them for MFU: 6 FLOPs per token for every
parameter a matrix multiply uses (2 in forward, 4 in backward), plus the attention
score and value products, 12 x layers x (heads x head size) x sequence length per token,
with no discount for the causal mask and no recomputation. Embedding lookups do no
matrix multiply, so their tables are left out, except where a table is also the output
projection (RoBERTa's tied LM head), which multiplies like any weight.

Peak FLOP/s are per rank: one GPU, one Trainium1 NeuronCore-v2, one Trainium2 logical
NeuronCore (LNC=2, four per chip), or this CPU as a timed matmul measures it. The device
of this process is named by torch for CUDA, and by the EC2 instance type for Trainium
(``neuron`` and ``xla`` devices): ``DISTLM_INSTANCE_TYPE``, else the DMI product name EC2
sets (``trn1.32xlarge``). ``DISTLM_PEAK_TFLOPS`` gives the peak of a device the table lacks.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import os
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from distlm.data.tokenizer import byte_dictionary
from distlm.errors import UsageError
from distlm.models import ARCHS, LlamaConfig, RobertaConfig, arch_config, arch_task

FAMILIES = ("llama", "roberta")

DTYPES = ("fp32", "bf16", "fp16")
_DTYPE_NAMES = {
    "fp32": "fp32", "float32": "fp32", "float": "fp32", "torch.float32": "fp32",
    "bf16": "bf16", "bfloat16": "bf16", "torch.bfloat16": "bf16",
    "fp16": "fp16", "float16": "fp16", "half": "fp16", "torch.float16": "fp16",
}


@dataclass(frozen=True)
class ModelShape:
    """The sizes that fix a transformer's parameters and FLOPs, laid out as distlm builds it."""

    family: str
    """``llama`` (pre-norm, SwiGLU, no biases, RMSNorm) or ``roberta`` (post-norm, GELU, biases, LayerNorm)."""
    dim: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    ffn_dim: int
    vocab_size: int
    max_positions: int
    padding_idx: int = 1
    """RoBERTa's learned position table has ``max_positions + padding_idx + 1`` rows (fairseq's offset)."""
    tied_output: bool = False
    """Whether the output projection is the token embedding (always for RoBERTa)."""

    @property
    def attention_dim(self) -> int:
        """Width of the query (and attention output) projection: heads x head size."""
        return self.n_heads * self.head_dim

    @property
    def kv_dim(self) -> int:
        return self.n_kv_heads * self.head_dim


def default_vocab_size(arch: str) -> int:
    """The vocabulary ``arch`` builds with when no data decides it: its own config's (the
    published archs carry their namesake's), else distlm's byte vocabulary (4 specials +
    256 bytes, + ``<mask>`` for masked LM), which the tiny archs train with."""
    configured = arch_config(arch).vocab_size
    if configured > 0:
        return configured
    return len(byte_dictionary()) + (1 if arch_task(arch) == "masked_lm" else 0)


def model_shape(model: object, vocab_size: int | None = None) -> ModelShape:
    """The shape of a distlm arch name, a ``config.json`` path of a Hugging Face Llama or
    RoBERTa, a ``LlamaConfig``/``RobertaConfig``, a built distlm model, or a ``ModelShape``.

    ``vocab_size`` overrides the vocabulary; a config with ``vocab_size=0`` (the arch
    registry's own) needs it.
    """
    if isinstance(model, ModelShape):
        shape = model
    elif isinstance(model, nn.Module):
        config = getattr(model, "config", None)
        if not isinstance(config, (LlamaConfig, RobertaConfig)):
            raise UsageError(f"{type(model).__name__} has no distlm LlamaConfig/RobertaConfig; pass a ModelShape")
        shape = _shape_of_config(config)
    elif isinstance(model, (LlamaConfig, RobertaConfig)):
        shape = _shape_of_config(model)
    elif isinstance(model, (str, Path)):
        name = str(model)
        if name in ARCHS:
            shape = _shape_of_config(arch_config(name))
            if vocab_size is None:
                vocab_size = default_vocab_size(name)
        elif name.endswith(".json") or Path(name).is_file():
            shape = shape_from_hf_config(name)
        else:
            raise UsageError(
                f"--arch {name} is neither a distlm arch ({', '.join(ARCHS)}) nor a Hugging Face config.json file"
            )
    else:
        raise TypeError(f"cannot read a model shape from {type(model).__name__}")
    if vocab_size is not None:
        if vocab_size <= 0:
            raise UsageError(f"--vocab-size must be positive, got {vocab_size}")
        shape = dataclasses.replace(shape, vocab_size=vocab_size)
    if shape.vocab_size <= 0:
        raise UsageError("the model's vocab_size is 0 (set from the data at build time); pass --vocab-size")
    return shape


def _shape_of_config(config: LlamaConfig | RobertaConfig) -> ModelShape:
    if isinstance(config, LlamaConfig):
        return ModelShape(
            family="llama", dim=config.dim, n_layers=config.n_layers, n_heads=config.n_heads,
            n_kv_heads=config.kv_heads, head_dim=config.head_dim, ffn_dim=config.ffn_hidden_dim,
            vocab_size=config.vocab_size, max_positions=config.max_seq_len, padding_idx=config.padding_idx,
        )
    return ModelShape(
        family="roberta", dim=config.dim, n_layers=config.n_layers, n_heads=config.n_heads,
        n_kv_heads=config.n_heads, head_dim=config.dim // config.n_heads, ffn_dim=config.ffn_dim,
        vocab_size=config.vocab_size, max_positions=config.max_positions, padding_idx=config.padding_idx,
        tied_output=True,
    )


def shape_from_hf_config(path: str | Path) -> ModelShape:
    """Read the standard fields of a Hugging Face ``config.json`` (``model_type`` llama or roberta).

    The shape is the one distlm would build: for RoBERTa, the position table holds
    ``max_position_embeddings`` rows (fairseq's padding offset included) and the one-row
    token-type embedding and pooler of Hugging Face's model are not part of it.
    """
    path = Path(path)
    try:
        fields = json.loads(path.read_text())
    except FileNotFoundError:
        raise UsageError(f"--arch {path}: no such file") from None
    except (OSError, json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise UsageError(f"--arch {path}: not a readable JSON config ({exc})") from None
    if not isinstance(fields, dict):
        raise UsageError(f"--arch {path}: a config.json holds one JSON object")
    model_type = fields.get("model_type")
    if model_type not in FAMILIES:
        raise UsageError(
            f"--arch {path}: model_type {model_type!r} is not supported; the planner reads llama and roberta"
        )

    def read(name: str, default: int | None = None) -> int:
        value = fields.get(name, default)
        if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
            raise UsageError(f"--arch {path}: field {name} must be a positive integer, got {value!r}")
        return value

    dim, n_heads = read("hidden_size"), read("num_attention_heads")
    if model_type == "llama":
        # Some configs (Gemma-style) give head_dim explicitly; Llama's leave it to hidden_size / heads.
        head_dim = read("head_dim") if fields.get("head_dim") is not None else dim // n_heads
        return ModelShape(
            family="llama", dim=dim, n_layers=read("num_hidden_layers"), n_heads=n_heads,
            n_kv_heads=read("num_key_value_heads", n_heads), head_dim=head_dim,
            ffn_dim=read("intermediate_size"), vocab_size=read("vocab_size"),
            max_positions=read("max_position_embeddings"),
            tied_output=bool(fields.get("tie_word_embeddings", False)),
        )
    padding_idx = fields.get("pad_token_id", 1)
    if not isinstance(padding_idx, int) or padding_idx < 0:
        raise UsageError(f"--arch {path}: field pad_token_id must be a non-negative integer, got {padding_idx!r}")
    table_rows = read("max_position_embeddings")
    if table_rows <= padding_idx + 1:
        raise UsageError(
            f"--arch {path}: max_position_embeddings {table_rows} leaves no positions after the padding offset"
        )
    return ModelShape(
        family="roberta", dim=dim, n_layers=read("num_hidden_layers"), n_heads=n_heads, n_kv_heads=n_heads,
        head_dim=dim // n_heads, ffn_dim=read("intermediate_size"), vocab_size=read("vocab_size"),
        max_positions=table_rows - padding_idx - 1, padding_idx=padding_idx, tied_output=True,
    )


# ------------------------------------------------------------------------- parameters


@dataclass(frozen=True)
class ParameterGroups:
    """Parameter counts by role, the pieces every estimate here is built from."""

    embedding: int
    """Lookup tables (token, and RoBERTa's positions); the tied output projection counts here once."""
    per_block: int
    """One transformer block."""
    head: int
    """After the blocks: final norm, untied output projection, RoBERTa's LM-head dense/norm/bias."""
    output_projection: int
    """Parameters of the vocabulary projection (shared with ``embedding`` when tied)."""
    blocks: int

    @property
    def total(self) -> int:
        return self.embedding + self.blocks * self.per_block + self.head


def parameter_groups(model: object) -> ParameterGroups:
    """Exact parameter counts of the model distlm builds for ``model`` (see ``model_shape``)."""
    s = model_shape(model)
    d, f, v = s.dim, s.ffn_dim, s.vocab_size
    output = v * d
    if s.family == "llama":
        attention = d * s.attention_dim + 2 * d * s.kv_dim + s.attention_dim * d
        block = attention + 3 * d * f + 2 * d  # wq wk wv wo, w1 w2 w3, two RMSNorm weights
        head = d + (0 if s.tied_output else output)  # final norm, output
        return ParameterGroups(embedding=v * d, per_block=block, head=head, output_projection=output, blocks=s.n_layers)
    attention = 3 * (d * s.attention_dim + s.attention_dim) + s.attention_dim * d + d
    block = attention + 2 * d + (d * f + f) + (f * d + d) + 2 * d  # attention, 2 LayerNorms, fc1, fc2
    positions = (s.max_positions + s.padding_idx + 1) * d
    embedding = v * d + positions + 2 * d  # token and position tables, embedding LayerNorm
    head = (d * d + d) + 2 * d + v  # LM head dense, LayerNorm, output bias; the projection is tied
    return ParameterGroups(embedding=embedding, per_block=block, head=head, output_projection=output, blocks=s.n_layers)


def count_parameter_tensors(model: object) -> int:
    """How many parameter tensors the model distlm builds for ``model`` holds (tied ones
    once): per-tensor costs, such as DTensor's dispatch in the optimizer step, scale with it."""
    s = model_shape(model)
    if s.family == "llama":
        # Token table; wq wk wv wo, w1 w2 w3 and two norms a block; final norm; the output unless tied.
        return 1 + 9 * s.n_layers + 1 + (0 if s.tied_output else 1)
    # Token and position tables and the embedding LayerNorm's two; per block the four attention
    # projections, fc1 and fc2 (weight and bias each) and two LayerNorms; the LM head's dense,
    # LayerNorm and output bias.
    return 4 + 16 * s.n_layers + 5


def count_parameters(config: object) -> int:
    """Exact parameter count of the model distlm builds from ``config`` (an arch name,
    a config with its vocabulary set, a config.json path, a model or a ``ModelShape``);
    tied weights count once, as ``sum(p.numel() for p in model.parameters())`` does."""
    return parameter_groups(config).total


def matmul_parameters(model: object) -> int:
    """Parameters multiplied per token: all but the lookup tables, with a tied output
    projection counted (it multiplies even though its storage is the embedding's)."""
    s = model_shape(model)
    groups = parameter_groups(s)
    lookups = groups.embedding - (groups.output_projection if s.tied_output else 0)
    if s.family == "roberta":
        lookups -= 2 * s.dim  # the embedding LayerNorm is not a lookup (torchtitan counts norms too)
    return groups.total - lookups


def flops_per_token(model_config_or_model: object, seq_len: int, output_fraction: float = 1.0) -> float:
    """Training FLOPs (forward + backward) per input token at sequence length ``seq_len``:
    ``6 x matmul parameters + 12 x layers x heads x head size x seq_len``, with no
    activation recomputation.

    ``output_fraction``: the share of positions at which the model computes its output, 1
    for a causal LM (every position). A masked LM computes its LM head (RoBERTa's dense
    layer, norm and output projection) only at the masked positions: pass the masked
    fraction of the tokens (``--mask-prob`` in expectation).
    """
    if seq_len <= 0:
        raise UsageError(f"sequence length must be positive, got {seq_len}")
    if not 0.0 <= output_fraction <= 1.0:
        raise UsageError(f"the fraction of positions with an output must be in [0, 1], got {output_fraction}")
    s = model_shape(model_config_or_model)
    matmuls = matmul_parameters(s)
    output = output_head_parameters(s)
    return 6.0 * (matmuls - output + output_fraction * output) + 12.0 * s.n_layers * s.attention_dim * seq_len


def output_head_parameters(model: object) -> int:
    """Parameters a token multiplies only where the model computes its output: the output
    projection, and RoBERTa's LM head before it (dense layer, LayerNorm, output bias)."""
    s = model_shape(model)
    groups = parameter_groups(s)
    return groups.output_projection + (groups.head if s.family == "roberta" else 0)


# ----------------------------------------------------------------------- peak FLOP/s

# Dense (no sparsity) peak per rank, in TFLOP/s. fp32 means plain IEEE fp32 matmuls
# (no TF32), which is what torch runs unless TF32 is allowed.
PEAK_TFLOPS: dict[str, dict[str, float]] = {
    # NVIDIA V100 SXM2: 125 tensor-core fp16, 15.7 fp32; no bf16.
    # https://images.nvidia.com/content/technologies/volta/pdf/volta-v100-datasheet-update-us-1165301-r5.pdf
    "V100": {"fp16": 125.0, "fp32": 15.7},
    # NVIDIA A100 SXM: 312 bf16/fp16 dense, 19.5 fp32.
    # https://www.nvidia.com/content/dam/en-zz/Solutions/Data-Center/a100/pdf/
    #   nvidia-a100-datasheet-us-nvidia-1758950-r4-web.pdf
    "A100": {"bf16": 312.0, "fp16": 312.0, "fp32": 19.5},
    # NVIDIA H100 SXM: 989 bf16/fp16 dense (the datasheet's 1,979 is with sparsity), 67 fp32.
    # https://resources.nvidia.com/en-us-tensor-core/nvidia-tensor-core-gpu-datasheet
    "H100": {"bf16": 989.0, "fp16": 989.0, "fp32": 67.0},
    # Trainium1 chip: 190 bf16/fp16 TFLOPS, 47.5 fp32, from two NeuronCore-v2: per core half.
    # https://awsdocs-neuron.readthedocs-hosted.com/en/latest/general/arch/neuron-hardware/trainium.html
    "trainium1": {"bf16": 95.0, "fp16": 95.0, "fp32": 23.75},
    # Trainium2 chip: 667 bf16/fp16 dense, 181 fp32, eight NeuronCore-v3; with the default
    # logical-core setting LNC=2 a rank is a pair of cores, four per chip: a quarter each.
    # https://awsdocs-neuron.readthedocs-hosted.com/en/latest/about-neuron/arch/neuron-hardware/trainium2.html
    "trainium2": {"bf16": 166.75, "fp16": 166.75, "fp32": 45.25},
}

# How device names spell each entry: torch.cuda.get_device_name(), and EC2 instance types
# (p3dn.24xlarge: V100, p4d/p4de: A100, p5.48xlarge: H100, trn1/trn1n: Trainium1, trn2: Trainium2).
_DEVICE_ALIASES = {
    "V100": ("v100", "p3.", "p3dn."),
    "A100": ("a100", "p4d.", "p4de."),
    "H100": ("h100", "p5."),
    "trainium1": ("trainium1", "trainium", "trn1", "neuroncore-v2"),
    "trainium2": ("trainium2", "trn2", "neuroncore-v3"),
}
DEVICE_TYPES = ("cuda", "neuron", "xla", "cpu")
INSTANCE_TYPE_VARIABLE = "DISTLM_INSTANCE_TYPE"
PEAK_VARIABLE = "DISTLM_PEAK_TFLOPS"
# EC2 writes the instance type here (e.g. "trn1.32xlarge"); containers may hide it.
PRODUCT_NAME_PATH = Path("/sys/devices/virtual/dmi/id/product_name")


def dtype_name(dtype: object) -> str:
    """``fp32``, ``bf16`` or ``fp16`` for a torch dtype or one of their usual spellings."""
    key = str(dtype).lower()
    if key not in _DTYPE_NAMES:
        raise UsageError(f"precision {dtype} is unknown; choose one of {', '.join(DTYPES)}")
    return _DTYPE_NAMES[key]


def instance_type() -> str | None:
    """This machine's EC2 instance type: ``DISTLM_INSTANCE_TYPE``, else the DMI product
    name; None when neither says anything."""
    named = os.environ.get(INSTANCE_TYPE_VARIABLE, "").strip()
    if named:
        return named
    try:
        return PRODUCT_NAME_PATH.read_text().strip() or None
    except OSError:
        return None


def local_device_name(device_type: str) -> str | None:
    """The name of this process's ``device_type`` device for the peak table: torch's for
    CUDA, the instance type for Trainium (``neuron``, ``xla``); None when unknown."""
    if device_type == "cuda":
        return torch.cuda.get_device_name() if torch.cuda.is_available() else instance_type()
    if device_type in ("neuron", "xla"):
        return instance_type()
    return None


def device_key(device_type: str, device_name: str | None) -> str:
    """The ``PEAK_TFLOPS`` entry of a device, e.g. ``A100`` for "NVIDIA A100-SXM4-40GB" or
    ``trainium1`` for "trn1.32xlarge"."""
    name = (device_name or "").lower()
    # Longest alias first, so "trainium2" is not read as "trainium".
    for key, aliases in sorted(_DEVICE_ALIASES.items(), key=lambda item: -max(map(len, item[1]))):
        if any(alias in name for alias in aliases):
            return key
    known = ", ".join(PEAK_TFLOPS)
    if device_name is None and device_type in ("neuron", "xla"):
        raise UsageError(
            f"no peak FLOP/s known for the {device_type} device: no EC2 instance type found "
            f"(set {INSTANCE_TYPE_VARIABLE}, e.g. trn1.32xlarge or trn2.48xlarge, or {PEAK_VARIABLE})"
        )
    raise UsageError(
        f"no peak FLOP/s known for {device_type} device {device_name!r}; known devices: {known} "
        f"(set {PEAK_VARIABLE} to its dense peak, or calibrate with --calibrate)"
    )


def peak_flops(device_type: str, dtype: object, device_name: str | None = None) -> float:
    """Peak dense FLOP/s of one rank on ``device_type`` (cuda, neuron, xla, cpu) in ``dtype``.

    For ``cpu`` the peak is measured (``measure_cpu_matmul_flops``); without a
    ``device_name``, this process's device is named (``local_device_name``).
    """
    precision = dtype_name(dtype)
    if device_type == "cpu":
        return measure_cpu_matmul_flops(precision)
    if device_type not in DEVICE_TYPES:
        raise UsageError(f"device type {device_type!r} is unknown; choose one of {', '.join(DEVICE_TYPES)}")
    if device_name is None:
        device_name = local_device_name(device_type)
    key = device_key(device_type, device_name)
    table = PEAK_TFLOPS[key]
    if precision not in table:
        raise UsageError(f"{key} has no {precision} arithmetic; choose one of {', '.join(table)}")
    return table[precision] * 1e12


def device_peak_flops(device_type: str, dtype: object) -> float:
    """Peak FLOP/s of this process's accelerator in ``dtype``: ``DISTLM_PEAK_TFLOPS`` when
    set, else the table entry of the device (``peak_flops``). UsageError when neither knows."""
    given = os.environ.get(PEAK_VARIABLE, "").strip()
    if given:
        try:
            value = float(given)
        except ValueError:
            value = 0.0
        if not value > 0 or not math.isfinite(value):
            raise UsageError(f"{PEAK_VARIABLE}={given!r} must be a positive number of TFLOP/s")
        return value * 1e12
    return peak_flops(device_type, dtype)


def model_flops_utilization(
    tokens_per_s: float, model_flops_per_token: float, peak_flops_per_rank: float, ranks: int
) -> float:
    """MFU: the model FLOP/s a run achieves over the peak of all its ranks."""
    return tokens_per_s * model_flops_per_token / (peak_flops_per_rank * ranks)


@functools.lru_cache(maxsize=None)
def measure_cpu_matmul_flops(
    dtype: object = "fp32", size: int = 512, min_seconds: float = 0.2, threads: int | None = None
) -> float:
    """FLOP/s of a ``size x size`` matmul on this CPU in ``dtype`` (best call of those
    run in about ``min_seconds``, after one warm-up), with ``threads`` intra-op threads
    (default: torch's current setting). Cached per argument set."""
    precision = dtype_name(dtype)
    torch_dtype = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[precision]
    previous_threads = torch.get_num_threads()
    if threads is not None:
        torch.set_num_threads(threads)
    try:
        generator = torch.Generator().manual_seed(0)
        a = torch.randn(size, size, generator=generator).to(torch_dtype)
        b = torch.randn(size, size, generator=generator).to(torch_dtype)
        torch.mm(a, b)  # warm-up: first-call allocation and kernel selection
        best = math.inf
        calls, spent = 0, 0.0
        while calls < 2 or spent < min_seconds:
            start = time.perf_counter()
            torch.mm(a, b)
            elapsed = time.perf_counter() - start
            best, spent, calls = min(best, elapsed), spent + elapsed, calls + 1
    finally:
        torch.set_num_threads(previous_threads)
    return 2.0 * size**3 / best
