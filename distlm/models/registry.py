"""The model families distlm builds, listed once, and what is looked up through them: a family by
name, arch, config or model; the published archs; ``build_model``.

A family is a folder of ``distlm/models`` whose ``__init__.py`` defines ``FAMILY`` (a
``ModelFamily``, distlm/models/family.py); adding one is that folder and its line below.
Torch-free: the command line checks ``--arch`` and the size flags before torch is imported.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
import types
import typing
from typing import Any

from distlm.choices import TASKS
from distlm.errors import UsageError
from distlm.models.family import TASK_RECORDS, ModelFamily

FAMILY_PACKAGES = ("distlm.models.roberta", "distlm.models.llama", "distlm.models.moe")
"""The packages of the model families, in the order their archs are listed."""

# Set by build_model's own arguments, so not accepted as overrides.
_BUILD_ARGUMENTS = ("vocab_size", "padding_idx")


@functools.cache
def families() -> dict[str, ModelFamily]:
    """Family name -> its record, in ``FAMILY_PACKAGES`` order."""
    found: dict[str, ModelFamily] = {}
    for package in FAMILY_PACKAGES:
        family = importlib.import_module(package).FAMILY
        if family.name in found:
            raise RuntimeError(f"two model families are named {family.name}: {package} and another")
        if family.task.name not in TASKS:
            raise RuntimeError(f"{package}: task {family.task.name} is not one of choices.TASKS")
        found[family.name] = family
    archs = [arch for family in found.values() for arch in family.archs]
    if len(set(archs)) != len(archs):
        raise RuntimeError(f"an arch name is published by two model families: {sorted(archs)}")
    return found


def family(name: str) -> ModelFamily:
    """The family a checkpoint or a planner shape names."""
    if name not in families():
        raise UsageError(f"model family {name!r} is unknown; distlm builds {', '.join(families())}")
    return families()[name]


def arch_names() -> list[str]:
    """Every published ``--arch``, family by family."""
    return [arch for family in families().values() for arch in family.archs]


def family_of_arch(arch: str) -> ModelFamily:
    """The family publishing ``arch``; one line naming the archs when none does."""
    for family in families().values():
        if arch in family.archs:
            return family
    raise UsageError(f"--arch {arch} is unknown; choose one of: {', '.join(arch_names())}")


def family_of_config(config: object) -> ModelFamily:
    """The family whose config class ``config`` is (the exact class: a mixture of experts'
    config is a Llama config too)."""
    for family in families().values():
        if type(config) is family.config_class:
            return family
    raise UsageError(f"a {type(config).__name__} is no distlm model config; distlm builds "
                     f"{', '.join(f.config_class.__name__ for f in families().values())}")


def family_of_model(model: object) -> ModelFamily | None:
    """The family of a distlm model (by its config); None for a model of the user's own."""
    config = getattr(model, "config", None)
    return next((family for family in families().values() if type(config) is family.config_class), None)


def flag_owner(flag: str) -> str | None:
    """The family a command-line model flag belongs to (the first that declares it); None for a
    setting every model has."""
    owners = [family.name for family in families().values() if flag in family.flags]
    return None if len(owners) == len(families()) else (owners[0] if owners else None)


def arch_overrides(settings: Any) -> dict[str, Any]:
    """``settings`` (a ``ModelConfig``) as overrides of its ``--arch``'s config fields; a flag of
    another family is one line naming both."""
    return family_of_arch(settings.arch).overrides(settings, settings.arch, flag_owner)


def task_of(name: str):
    """The ``Task`` record of a task name (``--task``, a model's ``task``)."""
    return TASK_RECORDS[name]


def arch_config(arch: str) -> Any:
    """The named arch's configuration (a copy), e.g. to check a tp degree before building anything."""
    return family_of_arch(arch).arch_config(arch)


def _accepts(annotation: object, value: object) -> bool:
    """Whether ``value`` fits a config field annotated ``int``, ``float`` or ``X | None``."""
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        return any(_accepts(arg, value) for arg in typing.get_args(annotation))
    if annotation is type(None):
        return value is None
    if annotation is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if annotation is int:
        return isinstance(value, int) and not isinstance(value, bool)
    return isinstance(value, annotation)


def build_model(arch: str, vocab_size: int | None = None, padding_idx: int | None = None, **overrides: object):
    """Build ``arch`` on the current default device (use ``with torch.device("meta")``
    for deferred initialisation, then ``to_empty`` and ``init_weights()``).

    ``vocab_size`` and ``padding_idx`` default to the arch's own: a published arch's
    vocabulary, padding id 1. ``overrides`` replace fields of the arch's config, e.g.
    ``dropout=0.0``.
    """
    family = family_of_arch(arch)
    base_config = family.archs[arch]
    if vocab_size is None:
        vocab_size = base_config.vocab_size
        if vocab_size <= 0:
            raise UsageError(f"--arch {arch} takes its vocabulary size from the data; pass vocab_size")
    if padding_idx is None:
        padding_idx = base_config.padding_idx
    # get_type_hints resolves the string annotations left by `from __future__ import annotations`.
    field_types = typing.get_type_hints(type(base_config))
    settings = [f.name for f in dataclasses.fields(base_config) if f.name not in _BUILD_ARGUMENTS]
    for name, value in overrides.items():
        if name not in settings:
            raise UsageError(
                f"--arch {arch} has no model setting '{name}'; valid settings: {', '.join(settings)}"
            )
        if not _accepts(field_types[name], value):
            raise UsageError(
                f"model setting {name}={value!r} has the wrong type for --arch {arch}; "
                f"expected {field_types[name]}"
            )
    config = dataclasses.replace(base_config, vocab_size=vocab_size, padding_idx=padding_idx, **overrides)
    return family.model_class(config)
