"""A Trainer used from Python behaves as the command line does: the start-up lines are
logged, the save dir is filled in the same way, and errors name the config field beside
the command-line flag.

A message says ``--save-dir``; a Python user sets ``config.checkpoint.save_dir``. Every
``UsageError`` leaving ``Trainer`` built from a config made in Python (not by
``parse_args``) names both: ``--save-dir (config.checkpoint.save_dir)``.
"""

from __future__ import annotations

import dataclasses
import functools
import re
from typing import Any, Callable

from distlm.config import SECTIONS, TrainConfig, build_parser, default_save_dir
from distlm.errors import UsageError, rank_from_environment
from distlm.observe.log_lines import use_default_logging

_FLAG = re.compile(r"--[a-z0-9][a-z0-9-]*")


def prepare_config(config: Any, model: Any = None) -> Any:
    """``config`` with what a run decides itself filled in (the save dir: checkpoints/MODEL),
    and distlm's log lines on for a program that configured no logging of its own."""
    use_default_logging(rank_from_environment())
    if config.checkpoint.save_dir is None:
        config.checkpoint.save_dir = default_save_dir(config, type(model).__name__ if model is not None else None)
    return config


def naming_config_fields(method: Callable) -> Callable:
    """Decorates a Trainer method: a ``UsageError`` it raises for a config made in Python
    names each flag's config field too."""

    @functools.wraps(method)
    def named(self: Any, *args: Any, **kwargs: Any) -> Any:
        try:
            return method(self, *args, **kwargs)
        except UsageError as err:
            config = getattr(self, "config", None)
            if config is None or getattr(config, "from_command_line", False) or not isinstance(err.args[0], str):
                raise
            err.args = (with_field_names(err.args[0]), *err.args[1:])
            raise

    return named


def with_field_names(message: str) -> str:
    """``message`` with the first mention of each known flag followed by its config field."""
    fields = _flag_fields()
    seen: set[str] = set()

    def name(match: re.Match) -> str:
        flag = match.group(0)
        if flag in seen or flag not in fields:
            return flag
        seen.add(flag)
        return f"{flag} (config.{fields[flag]})"

    return _FLAG.sub(name, message)


@functools.cache
def _flag_fields() -> dict[str, str]:
    """``--flag`` -> its field (``checkpoint.save_dir``), for every flag that sets a config field."""
    top_level = {field.name for field in dataclasses.fields(TrainConfig)} - set(SECTIONS)
    return {option: action.dest for action in build_parser()._actions for option in action.option_strings
            if option.startswith("--") and (action.dest.partition(".")[0] in SECTIONS or action.dest in top_level)}
