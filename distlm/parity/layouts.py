"""A layout (``"strategy=fsdp,dp=2"``) as distlm.train flags and a world size.

A key is a setting of the ``[distributed]``, ``[precision]`` or ``[compile]`` section
(``comm_hook``, ``bucket_cap_mb``, ``activation_checkpointing``...), ``batch_size`` or
``update_freq`` (so layouts of different dp can train on one global batch), or one of
the short names below. The reference is one process with the run's own flags; each layout adds
its keys to those flags, so what a layout leaves out is the run's setting. ``ep`` (expert
parallel) is carved out of the data-parallel ranks, so it adds no processes; without ``dp``
or ``world`` a layout has as many data-parallel ranks as ``ep``.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import get_type_hints

from distlm.choices import PRECISIONS
from distlm.config import CompileConfig, DataConfig, DistributedConfig, PrecisionConfig, parse_args
from distlm.errors import UsageError
from distlm.precision import precision_flags as precision_flags_of

# Short names of the degrees; "world" is the number of processes when dp is left to it.
_DEGREES = {"dp": "dp_degree", "tp": "tp_degree", "pp": "pp_degree"}
_SECTIONS = (DistributedConfig, PrecisionConfig, CompileConfig)
_DATA_KEYS = ("batch_size", "update_freq")
_PRECISION_KEYS = {f.name for f in dataclasses.fields(PrecisionConfig)}
# Set by the parity run itself, never by a layout.
_NOT_LAYOUT = {"distributed_world_size", "distributed_rank", "distributed_init_method", "device", "cpu",
               "timeout_sec", "precompile", "compile_cache"}


def _layout_fields() -> dict[str, type]:
    fields = {}
    for cls in _SECTIONS:
        hints = get_type_hints(cls)
        fields.update({f.name: hints[f.name] for f in dataclasses.fields(cls) if f.name not in _NOT_LAYOUT})
    hints = get_type_hints(DataConfig)
    fields.update({name: hints[name] for name in _DATA_KEYS})
    return fields


@dataclass
class Layout:
    text: str
    """As the user wrote it, e.g. ``strategy=fsdp,dp=2``."""
    flags: list[str]
    """distlm.train flags the layout adds to the run's."""
    world_size: int
    """Processes it runs on."""
    precision_flags: list[str] = dataclasses.field(default_factory=list)
    """The part of ``flags`` that sets the precision, which the layout's reference shares."""

    @property
    def name(self) -> str:
        """A directory name: the text with its separators replaced."""
        return self.text.replace("=", "-").replace(",", "_").replace("/", "-")

    def describe(self) -> str:
        return f"{self.text} ({self.world_size} process{'es' if self.world_size > 1 else ''})"


def parse_layout(text: str) -> Layout:
    """``"key=value,key=value"`` as a Layout; UsageError naming the layout and key when wrong."""
    fields = _layout_fields()
    flags: list[str] = []
    precision_flags: list[str] = []
    degrees = {"dp": None, "tp": 1, "pp": 1}
    ep = 1
    world = None
    seen = set()
    for item in filter(None, (part.strip() for part in text.split(","))):
        key, sep, value = item.partition("=")
        key, value = key.strip().replace("-", "_"), value.strip()
        if not sep or not value:
            raise UsageError(f"layout {text!r}: {item!r} is not key=value, e.g. \"strategy=fsdp,dp=2\"")
        if key in seen:
            raise UsageError(f"layout {text!r}: {key} given twice")
        seen.add(key)
        if key in _DEGREES or key in ("world", "ep"):
            number = _whole_number(text, key, value)
            if key == "world":
                world = number
                continue
            if key == "ep":
                ep = number
                flags += ["--ep-degree", str(number)]
                continue
            degrees[key] = number
            flags += [f"--{_DEGREES[key].replace('_', '-')}", str(number)]
        elif key == "precision":
            if value not in PRECISIONS:
                raise UsageError(f"layout {text!r}: precision={value} is not one of: {', '.join(PRECISIONS)}")
            flags += precision_flags_of(value)
            precision_flags += precision_flags_of(value)
        elif key in fields:
            flags += _flag(fields[key], key, value)
            if key in _PRECISION_KEYS:
                precision_flags += _flag(fields[key], key, value)
        else:
            known = ", ".join(["dp", "tp", "pp", "ep", "world", "precision", *sorted(fields)])
            raise UsageError(f"layout {text!r}: unknown key {key!r}; keys are {known}")
    if not seen:
        raise UsageError(f"layout {text!r} is empty; write e.g. \"strategy=fsdp,dp=2\"")
    model_parallel = degrees["tp"] * degrees["pp"]
    if world is None:
        world = (degrees["dp"] or ep) * model_parallel
    elif degrees["dp"] is not None and degrees["dp"] * model_parallel != world:
        raise UsageError(f"layout {text!r}: dp x tp x pp = {degrees['dp'] * model_parallel}, not world={world}")
    elif world % model_parallel:
        raise UsageError(f"layout {text!r}: world={world} is not a multiple of tp x pp = {model_parallel}")
    if (world // model_parallel) % ep:
        raise UsageError(f"layout {text!r}: ep={ep} does not divide the {world // model_parallel} data-parallel "
                         "ranks it is carved out of; choose a divisor of dp")
    return Layout(text, flags, world, precision_flags)


def _whole_number(text: str, key: str, value: str) -> int:
    if not value.isdigit() or int(value) < 1:
        raise UsageError(f"layout {text!r}: {key}={value} must be a whole number of at least 1")
    return int(value)


def _flag(hint, key: str, value: str) -> list[str]:
    flag = f"--{key.replace('_', '-')}"
    default = next(f.default for cls in (*_SECTIONS, DataConfig) for f in dataclasses.fields(cls) if f.name == key)
    if hint is bool and default is False:
        # An off-by-default switch takes no value on the command line.
        if value.lower() in ("true", "yes", "1", "on"):
            return [flag]
        if value.lower() in ("false", "no", "0", "off"):
            return []
        raise UsageError(f"{flag}: cannot parse {value!r} as true or false")
    return [flag, value]


def check_layout(layout: Layout, run_flags: list[str]) -> None:
    """The run's flags with the layout's parse and pass distlm.train's checks."""
    try:
        parse_args(run_flags + layout.flags)
    except UsageError as exc:
        raise UsageError(f"layout {layout.text!r}: {exc}") from None
