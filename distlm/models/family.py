"""A model family as one record: what distlm knows of RoBERTa, Llama or a mixture of experts,
and the one place the rest of distlm asks (torchtitan's ``ModelSpec``, in distlm's words).

``ModelFamily`` holds the family's task, config class and published archs, the command-line
flags that size it, its size formulas (``FamilySizes``: shape, parameters, tensor-parallel
shares), and, loaded with torch when first asked, its model class (whose ``tp_plan`` and
pipeline parts are data on the class) and Hugging Face adapters. The command line, the
builder, FLOP counts, the planner, checkpoints and exports read a family's facts from its
record and never branch on its name. A family is a folder of ``distlm/models`` whose
``__init__.py`` defines ``FAMILY``, listed once in ``distlm/models/registry.py``.

Nothing here imports torch: the command line checks ``--arch`` and the size flags before
torch is imported, so a family's ``__init__``, config and sizes are torch-free, and its torch
parts live in the module named by ``parts``.
"""

from __future__ import annotations

import dataclasses
import importlib
from dataclasses import dataclass, field
from types import ModuleType
from typing import Any, Callable, Mapping

from distlm.errors import UsageError
from distlm.models.sizes import LocalParameters, ModelShape, ParameterGroups


@dataclass(frozen=True)
class Task:
    """A training objective: which positions a model predicts, and so where its output runs."""

    name: str
    """One of ``choices.TASKS``: what ``--task`` and a model's ``task`` say."""
    predicts_masked_positions: bool
    """A masked LM predicts (and computes its output at) the masked positions only; a causal LM every position."""
    attends_causally: bool
    """A position sees only the positions before it (a causal LM), so packed documents can be kept
    apart by a document mask; a masked LM attends both ways."""

    def output_fraction(self, mask_prob: float) -> float:
        """The share of positions the model computes its output at: ``--mask-prob`` (in
        expectation) for a masked LM, every position for a causal LM."""
        return mask_prob if self.predicts_masked_positions else 1.0


MASKED_LM = Task("masked_lm", predicts_masked_positions=True, attends_causally=False)
CAUSAL_LM = Task("causal_lm", predicts_masked_positions=False, attends_causally=True)
TASK_RECORDS: dict[str, Task] = {task.name: task for task in (MASKED_LM, CAUSAL_LM)}
"""Task name -> its record; the names are ``choices.TASKS`` (checked by the architecture test)."""


@dataclass(frozen=True)
class FamilySizes:
    """A family's size formulas, as distlm builds its models: pure arithmetic on the config."""

    shape: Callable[[Any], ModelShape]
    """Config -> the sizes every count below reads."""
    parameter_groups: Callable[[ModelShape], ParameterGroups]
    """Exact parameter counts by role."""
    parameter_tensors: Callable[[ModelShape], int]
    """How many parameter tensors the model holds (tied ones once)."""
    local_parameters: Callable[[ModelShape, int, int], LocalParameters]
    """(shape, tp, ep) -> the parameters one tensor-parallel (and expert-parallel) rank holds
    under the family's tensor-parallel plan."""
    output_split_by_tp: bool
    """Whether tensor parallel splits the output projection over the vocabulary (its logits are
    then ``1/tp`` per rank); otherwise every rank computes all of them."""
    describe: Callable[[Any], str]
    """The family's part of the start-up log's shape line (positions, tied output, experts)."""


@dataclass(frozen=True)
class ModelFamily:
    """Everything distlm knows of one model family (see the module docstring)."""

    name: str
    """The family's name as fairseq's architecture flags and Hugging Face's ``model_type`` say it,
    and as checkpoints record it."""
    task: Task
    config_class: type
    archs: Mapping[str, Any]
    """Published arch name (``--arch``) -> its config. A published arch carries its vocabulary
    size; the tiny ones leave ``vocab_size`` 0, set from the data at build time."""
    flags: Mapping[str, str]
    """Command-line setting (a ``distlm.config.ModelConfig`` field) -> the config field it sets."""
    sizes: FamilySizes
    parts: str
    """The module that holds ``MODEL`` (the model class) and ``HF_ADAPTERS``; imported with torch
    when first asked, so that the command line can read the rest before torch loads."""
    flag_values: Mapping[str, Mapping[str, Any]] = field(default_factory=dict)
    """Flags whose command-line names differ from their config field's values: flag -> name -> value."""
    flag_implies: Mapping[str, tuple[str, str]] = field(default_factory=dict)
    """Flag -> (flag, field): given without that second flag, the first also sets that field
    (new query heads without --kv-heads: one key/value head per query head, never the arch's
    old grouping silently kept)."""
    size_fields: tuple[str, ...] = ()
    """Config fields that fix the model's sizes: with --init-from-hf they come from config.json,
    so flags may not set them."""
    arch_fields: tuple[str, ...] = ()
    """Config fields (besides the vocabulary) in which an --arch given with --init-from-hf must
    agree with its config.json to name the same model."""
    positions_from_samples: tuple[str, ...] = ()
    """Archs trained from scratch whose learned positions follow --tokens-per-sample when
    --max-positions is not given, as fairseq's masked LM sizes them."""

    @property
    def model_class(self) -> type:
        return self._parts().MODEL

    @property
    def hf_adapters(self) -> tuple:
        """The family's Hugging Face adapters (``distlm.models.hf.common.HFAdapter``)."""
        return tuple(self._parts().HF_ADAPTERS)

    def _parts(self) -> ModuleType:
        return importlib.import_module(self.parts)

    def arch_config(self, arch: str) -> Any:
        """A copy of a published arch's config."""
        return dataclasses.replace(self.archs[arch])

    def overrides(self, settings: Any, arch: str | None, flag_owner: Callable[[str], str]) -> dict[str, Any]:
        """The model settings given on the command line (``settings``, a ``ModelConfig``) as
        overrides of this family's config fields. A flag of another family is one line naming
        both; ``flag_owner(flag)`` names the family a flag belongs to."""
        overrides: dict[str, Any] = {}
        for flag, field_name in self.flags.items():
            value = getattr(settings, flag)
            if value is not None:
                overrides[field_name] = self.flag_values[flag][value] if flag in self.flag_values else value
        for flag, (unless, field_name) in self.flag_implies.items():
            if getattr(settings, flag) is not None and getattr(settings, unless) is None:
                overrides[field_name] = getattr(settings, flag)
        for flag in (f.name for f in dataclasses.fields(settings)):
            if flag in self.flags or getattr(settings, flag) is None:
                continue
            owner = flag_owner(flag)
            if owner is None:
                continue  # a setting of every family (--arch, --vocab-size, ...), not a family's flag
            verb = "sizes" if flag.startswith(("encoder_", "decoder_")) else "belongs to"
            raise UsageError(
                f"--{flag.replace('_', '-')} {verb} a {owner} model, but --arch {arch} is a {self.name} "
                f"model; drop it or use {self.describe_flags()}"
            )
        return overrides

    def describe_flags(self) -> str:
        """How the help names this family's size flags: ``the --decoder-* flags``."""
        prefixes = sorted({flag.split("_")[0] for flag in self.flags if flag.startswith(("encoder_", "decoder_"))})
        return " and ".join(f"the --{prefix}-* flags" for prefix in prefixes) or f"{self.name}'s own flags"
