"""Model FLOPs per token and exact parameter counts, for every family alike.

FLOPs are counted as torchtitan counts them for MFU: 6 FLOPs per token for every
parameter a matrix multiply uses (2 in forward, 4 in backward), plus the attention
score and value products, 12 x layers x (heads x head size) x sequence length per token,
with no discount for the causal mask and no recomputation (with document masks, each
document's own length instead: ``attention_flops_per_pair``). Embedding lookups do no
matrix multiply, so their tables are left out, except where a table is also the output
projection (a tied LM head), which multiplies like any weight.

A model's shape and parameter counts are its family's formulas (``FamilySizes``, in the
family's folder); what is counted from them is the same for every family. The peak FLOP/s
these are divided by are facts of the hardware: ``distlm.backends.hardware``.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

from distlm.data.tokenizer import byte_dictionary
from distlm.errors import UsageError
from distlm.models import registry
from distlm.models.hf import adapter_for_hf
from distlm.models.sizes import LocalParameters, ModelShape, ParameterGroups


def default_vocab_size(arch: str) -> int:
    """The vocabulary ``arch`` builds with when no data decides it: its own config's (the
    published archs carry their namesake's), else distlm's byte vocabulary (4 specials +
    256 bytes, + ``<mask>`` where the task masks), which the tiny archs train with."""
    configured = registry.arch_config(arch).vocab_size
    if configured > 0:
        return configured
    return len(byte_dictionary()) + (1 if registry.family_of_arch(arch).task.predicts_masked_positions else 0)


def model_shape(model: object, vocab_size: int | None = None) -> ModelShape:
    """The shape of a distlm arch name, a ``config.json`` path of a Hugging Face model distlm
    converts, a distlm model config, a built distlm model, or a ``ModelShape``.

    ``vocab_size`` overrides the vocabulary; a config with ``vocab_size=0`` (the arch
    registry's own) needs it.
    """
    if isinstance(model, ModelShape):
        shape = model
    elif isinstance(model, (str, Path)):
        name = str(model)
        if name in registry.arch_names():
            shape = shape_of_config(registry.arch_config(name))
            if vocab_size is None:
                vocab_size = default_vocab_size(name)
        elif name.endswith(".json") or Path(name).is_file():
            shape = shape_from_hf_config(name)
        else:
            raise UsageError(f"--arch {name} is neither a distlm arch ({', '.join(registry.arch_names())}) "
                             "nor a Hugging Face config.json file")
    elif dataclasses.is_dataclass(model) and not isinstance(model, type):
        shape = shape_of_config(model)
    elif registry.family_of_model(model) is not None:
        shape = shape_of_config(model.config)
    else:
        raise TypeError(f"cannot read a model shape from {type(model).__name__}: not a distlm model, config, "
                        "arch or config.json; pass a ModelShape")
    if vocab_size is not None:
        if vocab_size <= 0:
            raise UsageError(f"--vocab-size must be positive, got {vocab_size}")
        shape = dataclasses.replace(shape, vocab_size=vocab_size)
    if shape.vocab_size <= 0:
        raise UsageError("the model's vocab_size is 0 (set from the data at build time); pass --vocab-size")
    return shape


def shape_of_config(config: object) -> ModelShape:
    return registry.family_of_config(config).sizes.shape(config)


def shape_from_hf_config(path: str | Path) -> ModelShape:
    """The shape of a Hugging Face ``config.json`` of a model distlm converts: the model distlm
    would build from it, read through its family's adapter (transformers' defaults for absent
    keys, and what distlm cannot build refused). For RoBERTa the position table holds
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
    try:
        config, _ = adapter_for_hf(fields).config_from_hf(fields)
    except UsageError as err:
        raise UsageError(f"--arch {path}: {err}") from None
    return shape_of_config(config)


def _family_sizes(shape: ModelShape):
    return registry.family(shape.family).sizes


def parameter_groups(model: object) -> ParameterGroups:
    """Exact parameter counts of the model distlm builds for ``model`` (see ``model_shape``)."""
    s = model_shape(model)
    return _family_sizes(s).parameter_groups(s)


def count_parameter_tensors(model: object) -> int:
    """How many parameter tensors the model distlm builds for ``model`` holds (tied ones
    once): per-tensor costs, such as DTensor's dispatch in the optimizer step, scale with it."""
    s = model_shape(model)
    return _family_sizes(s).parameter_tensors(s)


def local_parameters(shape: ModelShape, tp: int, ep: int = 1) -> LocalParameters:
    """Parameter counts per tensor-parallel rank under the family's tensor-parallel plan, with
    a mixture of experts' routed experts apart under expert parallel (``ep``)."""
    return _family_sizes(shape).local_parameters(shape, tp, ep)


def count_parameters(config: object) -> int:
    """Exact parameter count of the model distlm builds from ``config`` (an arch name,
    a config with its vocabulary set, a config.json path, a model or a ``ModelShape``);
    tied weights count once, as ``sum(p.numel() for p in model.parameters())`` does."""
    return parameter_groups(config).total


def matmul_parameters(model: object) -> int:
    """Parameters multiplied per token: all but the lookup tables, with a tied output
    projection counted (it multiplies even though its storage is the embedding's)."""
    groups = parameter_groups(model)
    return groups.total - groups.lookups


def active_matmul_parameters(model: object) -> int:
    """``matmul_parameters`` a token multiplies: a mixture of experts' token uses its top-k
    routed experts of each MoE layer, not all of them (the rest are the same as ``matmul_parameters``)."""
    s = model_shape(model)
    return matmul_parameters(s) - s.inactive_expert_parameters


def flops_per_token(model_config_or_model: object, seq_len: int, output_fraction: float = 1.0) -> float:
    """Training FLOPs (forward + backward) per input token at sequence length ``seq_len``:
    ``6 x matmul parameters + 12 x layers x heads x head size x seq_len``, with no
    activation recomputation. A mixture of experts counts its active parameters (a token's
    top-k experts, ``active_matmul_parameters``), as torchtitan counts them.

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
    matmuls = active_matmul_parameters(s)
    output = output_head_parameters(s)
    return 6.0 * (matmuls - output + output_fraction * output) + attention_flops_per_pair(s) * seq_len


def attention_flops_per_pair(model: object) -> float:
    """Training FLOPs of the attention score and value products for one (query, key) pair of a
    sequence: ``12 x layers x heads x head size``. A sequence of T tokens counts T^2 pairs, as
    :func:`flops_per_token` counts them (no causal discount); packed with document masks, a
    block counts the sum of its documents' squared lengths, the attention actually computed."""
    s = model_shape(model)
    return 12.0 * s.n_layers * s.attention_dim


def output_head_parameters(model: object) -> int:
    """Parameters a token multiplies only where the model computes its output: the output
    projection, and what runs before it there only (RoBERTa's LM head: dense, LayerNorm, bias)."""
    return parameter_groups(model).output_head


def model_flops_utilization(
    tokens_per_s: float, model_flops_per_token: float, peak_flops_per_rank: float, ranks: int
) -> float:
    """MFU: the model FLOP/s a run achieves over the peak of all its ranks."""
    return tokens_per_s * model_flops_per_token / (peak_flops_per_rank * ranks)
