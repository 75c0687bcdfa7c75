"""The shape of the code: one home per set of choices and per default of the run's layout, no
cycle-hiding imports, the model contract checked in one line, and one host synchronisation per update."""

from __future__ import annotations

import ast
import contextlib
import dataclasses
from pathlib import Path

import pytest
import torch

import distlm
from distlm import choices
from distlm.backends.hardware import HALF_PRECISION_MATMUL_PATHS
from distlm.backends.registry import BACKENDS
from distlm.config import DistributedConfig, build_parser, parse_args
from distlm.models.llama import ROPE_SCALING_TYPES
from distlm.errors import UsageError
from distlm.layout import PIPELINE_PREFIX, Layout, PipelineLayout
from distlm.training.memory import ZERO_STAGES
from distlm.parallel.pipeline import SCHEDULES
from distlm.precision import DTYPES, MODE_DTYPES
from distlm.training import trainer as trainer_module
from distlm.training import validation
from distlm.training.builder import resolve_model_spec
from distlm.training.trainer import Trainer
from distributed import run_distributed
from test_ddp import common_args

PACKAGE = Path(distlm.__file__).parent


def _modules() -> list[tuple[Path, ast.Module]]:
    return [(path, ast.parse(path.read_text())) for path in sorted(PACKAGE.rglob("*.py"))]


def test_every_set_of_choices_is_declared_once_and_used_by_the_command_line():
    # The command line offers exactly the registry's values, and refuses anything else by name.
    actions = {action.dest.rpartition(".")[2]: action for action in build_parser()._actions}
    for name, allowed in choices.CHOICES.items():
        assert name in actions, name
        assert f"Choices: {', '.join(allowed)}." in actions[name].help, name
        with pytest.raises(UsageError, match=f"--{name.replace('_', '-')} nonsense is not one of"):
            parse_args([f"--{name.replace('_', '-')}", "nonsense"])
    # A registry keyed by choices offers exactly them.
    assert set(BACKENDS) == set(choices.DEVICES) - {"auto"}
    assert set(MODE_DTYPES) == set(choices.PRECISIONS)
    assert set(DTYPES) < set(choices.PRECISIONS)
    assert set(ROPE_SCALING_TYPES) == set(choices.ROPE_SCALINGS)
    assert set(ZERO_STAGES) == set(choices.STRATEGIES)
    assert set(SCHEDULES) == set(choices.PP_SCHEDULES)
    assert set(choices.PP_LOOPED_SCHEDULES) < set(choices.PP_SCHEDULES)
    assert set(choices.PP_ZERO_BUBBLE_SCHEDULES) < set(choices.PP_LOOPED_SCHEDULES)
    assert set(choices.PROFILE_DEVICE_TYPES) < set(choices.DEVICES)
    assert set(HALF_PRECISION_MATMUL_PATHS) < set(choices.PRECISIONS)
    assert restated_choices() == []


# The tables that map each value of a set to its facts: their keys are checked above, or
# are facts themselves (which precisions a device's arithmetic has).
_TABLES = {
    "distlm/backends/registry.py": {"BACKENDS"},
    "distlm/precision.py": {"DTYPES", "MODE_DTYPES"},
    "distlm/backends/hardware.py": {"PEAK_TFLOPS", "HALF_PRECISION_MATMUL_PATHS"},
    "distlm/models/llama/__init__.py": {"ROPE_SCALING_TYPES"},
    "distlm/training/memory.py": {"ZERO_STAGES"},
    "distlm/parallel/pipeline.py": {"SCHEDULES"},
}


def _string_values(nodes: list) -> set[str] | None:
    if all(isinstance(node, ast.Constant) and isinstance(node.value, str) for node in nodes):
        values = {node.value for node in nodes}
        return values if len(values) >= 2 else None
    return None


def _restated(values: set[str], kind: str, sets: dict[str, set[str]]) -> list[str]:
    """The sets that ``values`` restates: a tuple, list or set holding at least half of one
    (a test for one or two special values is no restatement), a dict keyed by values of one,
    or a ``Literal`` of them."""
    found = []
    for name, allowed in sets.items():
        if values <= allowed and (kind != "collection" or 2 * len(values) >= len(allowed)):
            found.append(name)
    return found


def restated_choices(sources: dict[str, str] | None = None) -> list[str]:
    """``path:line kind restates NAME`` for every set of ``choices.py`` written again
    elsewhere (``sources``: path -> text; default every module of distlm)."""
    sets = {name: set(value) for name, value in vars(choices).items() if name.isupper() and isinstance(value, tuple)}
    if sources is None:
        sources = {path.relative_to(PACKAGE.parent).as_posix(): path.read_text() for path, _ in
                   ((path, None) for path in sorted(PACKAGE.rglob("*.py")))}
    found = []
    for path, text in sources.items():
        if path.endswith("/choices.py"):
            continue
        tree = ast.parse(text)
        exempt: set[int] = set()
        for node in tree.body:
            targets = node.targets if isinstance(node, ast.Assign) else [node.target] if isinstance(node, ast.AnnAssign) else []
            if any(isinstance(t, ast.Name) and t.id in _TABLES.get(path, ()) for t in targets):
                exempt.update(id(inner) for inner in ast.walk(node))
        for node in ast.walk(tree):
            if id(node) in exempt:
                continue
            values, kind = None, "collection"
            if isinstance(node, ast.Subscript) and isinstance(node.value, (ast.Name, ast.Attribute)) and \
                    getattr(node.value, "id", getattr(node.value, "attr", "")) == "Literal":
                elements = node.slice.elts if isinstance(node.slice, ast.Tuple) else [node.slice]
                values, kind = _string_values(elements), "Literal"
                exempt.update(id(inner) for inner in ast.walk(node.slice))
            elif isinstance(node, ast.Dict) and None not in node.keys:
                values, kind = _string_values(node.keys), "dict keys"
            elif isinstance(node, (ast.Tuple, ast.List, ast.Set)):
                values = _string_values(node.elts)
            if values:
                found += [f"{path}:{node.lineno} {kind} restates {name}" for name in _restated(values, kind, sets)]
    return found


def test_a_restated_set_of_choices_is_found_as_a_subset_dict_or_literal():
    source = """
from typing import Literal
Mode = Literal["fp32", "bf16"]
BYTES = {"fp32": 4, "memory_efficient_fp16": 2}
HALF = ("fp16", "memory_efficient_fp16")
SPECIAL = ("auto", "cpu")
"""
    found = restated_choices({"distlm/example.py": source})
    assert found == [
        "distlm/example.py:3 Literal restates PRECISIONS",
        "distlm/example.py:4 dict keys restates PRECISIONS",
        "distlm/example.py:5 collection restates PRECISIONS",
    ], found


def layout_defaults() -> dict[str, tuple[str, object]]:
    """Setting name -> (where the layout declares it, its default), for every setting of the
    layout and its pipeline part, the pipeline's under both its own and its ``pp_`` name. None
    means "not given" wherever it is a default (a tool's own ``--ranks-per-node`` included), so
    only a concrete default can be restated."""
    defaults = {}
    for cls, names in ((Layout, lambda name: [name]), (PipelineLayout, lambda name: [name, PIPELINE_PREFIX + name])):
        for f in dataclasses.fields(cls):
            if f.default is not dataclasses.MISSING and f.default is not None:
                defaults.update({name: (f"{cls.__name__}.{f.name}", f.default) for name in names(f.name)})
    return defaults


def _literal(node: ast.expr) -> object:
    """The value of a literal (a one-element list of one too, as a comma-separated flag's
    default); MISSING for anything computed, such as ``Layout.bucket_cap_mb``."""
    try:
        value = ast.literal_eval(node)
    except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
        return dataclasses.MISSING
    return value[0] if isinstance(value, (list, tuple)) and len(value) == 1 else value


def _named_defaults(tree: ast.Module):
    """``(name, value node, kind)`` of every parameter default, class field default (a
    dataclass's, ``field(default=...)`` included) and argparse ``default=`` (named by its dest)."""
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            positional = node.args.posonlyargs + node.args.args
            for arg, default in zip(positional[len(positional) - len(node.args.defaults):], node.args.defaults):
                yield arg.arg, default, "parameter default"
            for arg, default in zip(node.args.kwonlyargs, node.args.kw_defaults):
                if default is not None:
                    yield arg.arg, default, "parameter default"
        elif isinstance(node, ast.ClassDef):
            for item in node.body:
                if isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name) and item.value is not None:
                    value = item.value
                    if isinstance(value, ast.Call) and getattr(value.func, "id", getattr(value.func, "attr", None)) == \
                            "field":
                        value = next((k.value for k in value.keywords if k.arg == "default"), None)
                    if value is not None:
                        yield item.target.id, value, "field default"
        elif isinstance(node, ast.Call):
            default = next((k.value for k in node.keywords if k.arg == "default"), None)
            flags = [a.value for a in node.args if isinstance(a, ast.Constant) and str(a.value).startswith("--")]
            if default is None or not flags:
                continue
            dest = next((k.value.value for k in node.keywords if k.arg == "dest" and isinstance(k.value, ast.Constant)),
                        flags[0][2:].replace("-", "_"))
            yield dest, default, "argparse default"


def restated_layout_defaults(sources: dict[str, str] | None = None) -> list[str]:
    """``path:line KIND NAME=VALUE restates Layout.FIELD`` for every default of the layout written
    again as a literal outside distlm/layout.py (``sources``: path -> text; default every module
    of distlm)."""
    defaults = layout_defaults()
    if sources is None:
        sources = {path.relative_to(PACKAGE.parent).as_posix(): path.read_text()
                   for path in sorted(PACKAGE.rglob("*.py"))}
    found = []
    for path, text in sources.items():
        if path == "distlm/layout.py":
            continue
        for name, node, kind in _named_defaults(ast.parse(text)):
            if name not in defaults:
                continue
            home, default = defaults[name]
            value = _literal(node)
            # 25 restates 25.0; True never restates 1.
            if value == default and isinstance(value, bool) == isinstance(default, bool):
                found.append(f"{path}:{node.lineno} {kind} {name}={value!r} restates {home}")
    return found


def test_every_default_of_the_layout_has_one_home():
    # The command line's settings are the layout's, with its defaults.
    config = {f.name: f.default for f in dataclasses.fields(DistributedConfig)}
    for name, value in Layout().settings().items():
        assert name in config and config[name] == value, name
    assert restated_layout_defaults() == []


def test_a_restated_layout_default_is_found_as_a_parameter_field_or_flag_default():
    source = """
import argparse
from dataclasses import dataclass, field
from distlm.layout import Layout

@dataclass
class Options:
    bucket_cap_mb: float = 25
    schedule: str = field(default="1f1b")
    comm_hook: str = Layout.comm_hook

def apply(model, pp_stages_per_rank=1, *, sequence_parallel: bool = False, tp_degree: int = 2):
    pass

parser = argparse.ArgumentParser()
parser.add_argument("--dp-degree", type=int, default=-1)
parser.add_argument("--tp-degree", default=[1])
parser.add_argument("--pp-microbatches", default=4)
parser.add_argument("--nodes-per-job", dest="ranks_per_node", default=None)
"""
    found = restated_layout_defaults({"distlm/example.py": source})
    assert found == [
        "distlm/example.py:8 field default bucket_cap_mb=25 restates Layout.bucket_cap_mb",
        "distlm/example.py:9 field default schedule='1f1b' restates PipelineLayout.schedule",
        "distlm/example.py:12 parameter default pp_stages_per_rank=1 restates PipelineLayout.stages_per_rank",
        "distlm/example.py:12 parameter default sequence_parallel=False restates Layout.sequence_parallel",
        "distlm/example.py:16 argparse default dp_degree=-1 restates Layout.dp_degree",
        "distlm/example.py:17 argparse default tp_degree=1 restates Layout.tp_degree",
    ], found


# Imports of optional packages belong inside the function that needs them; what may never
# hide inside a function is an import of distlm itself (a cycle, or a layering problem).
# The exceptions: the package's lazy attributes (`import distlm.data` in a data worker must
# not load the trainer) and the entry point's training, which loads torch, the models and the
# data only once the command line is parsed, so that --help and a refused flag answer at once;
# and ZeRO-1's optimizer, whose base (torch.distributed.optim) scripts a dozen functional
# optimizers as it loads, a start-up cost only that strategy should pay.
_LAZY_BY_DESIGN = {("__init__.py", "__getattr__"), ("train.py", "train"), ("parallel/handle.py", "build_optimizer")}


def test_no_module_of_distlm_imports_distlm_inside_a_function():
    found = []
    for path, tree in _modules():
        for function in (n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))):
            if (path.relative_to(PACKAGE).as_posix(), function.name) in _LAZY_BY_DESIGN:
                continue
            for node in ast.walk(function):
                names = [node.module or ""] if isinstance(node, ast.ImportFrom) else \
                    [alias.name for alias in node.names] if isinstance(node, ast.Import) else []
                if any(name == "distlm" or name.startswith("distlm.") for name in names):
                    found.append(f"{path.relative_to(PACKAGE.parent)}:{node.lineno} in {function.name}()")
    assert not found, found


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def import_graph() -> dict[str, set[str]]:
    """Module -> the distlm modules it imports when it is loaded: every import outside a
    function or class body (under ``if``/``try`` too, ``TYPE_CHECKING`` included, since a
    type annotation is a dependency as well). ``from package import name`` points at the
    submodule where ``name`` is one, else at the package."""
    files = {_module_name(path): path for path in sorted(PACKAGE.rglob("*.py"))}
    graph: dict[str, set[str]] = {}
    for name, path in files.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        targets: set[str] = set()

        def visit(nodes: list[ast.stmt]) -> None:
            for node in nodes:
                if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                    continue
                if isinstance(node, ast.Import):
                    targets.update(alias.name for alias in node.names)
                elif isinstance(node, ast.ImportFrom):
                    base = node.module or ""
                    if node.level:
                        anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                        base = ".".join(anchor + ([base] if base else []))
                    for alias in node.names:
                        targets.add(f"{base}.{alias.name}" if f"{base}.{alias.name}" in files else base)
                else:
                    for block in ("body", "orelse", "finalbody", "handlers"):
                        visit(getattr(node, block, None) or [])

        visit(ast.parse(path.read_text()).body)
        graph[name] = {target for target in targets if target in files and target != name}
    return graph


def import_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    cycles: list[list[str]] = []

    def connect(module: str) -> None:
        index[module] = low[module] = len(index)
        stack.append(module)
        for target in sorted(graph[module]):
            if target not in index:
                connect(target)
                low[module] = min(low[module], low[target])
            elif target in stack:
                low[module] = min(low[module], index[target])
        if low[module] == index[module]:
            component = stack[stack.index(module):]
            del stack[stack.index(module):]
            if len(component) > 1:
                cycles.append(sorted(component))

    for module in sorted(graph):
        if module not in index:
            connect(module)
    return cycles


TOOLS = ("distlm.plan", "distlm.bench", "distlm.doctor", "distlm.report", "distlm.parity")
ENTRY_POINT = "distlm.train"


def _is_tool(module: str) -> bool:
    return any(module == tool or module.startswith(tool + ".") for tool in TOOLS)


def test_import_graph_has_no_cycle_and_the_core_imports_no_tool():
    graph = import_graph()
    assert graph["distlm.training.validation"] and "distlm.training.builder" in graph["distlm.training.validation"]  # the graph sees imports
    assert import_cycles(graph) == []
    crossing = sorted(
        (module, target) for module, targets in graph.items() for target in targets
        if not _is_tool(module) and _is_tool(target)
    )
    assert crossing == [], "core modules import tools"
    entry = sorted(module for module, targets in graph.items() if ENTRY_POINT in targets)
    assert entry == [], "only launchers run the entry point; its helpers live in distlm.errors"


# Each layer of distlm (a subpackage, or a module at the top) and the layers it may import when
# loaded, lowest first, as each package's docstring says. Tools and entry points may import any
# layer; no layer imports a tool (above) or the entry point.
LAYERS: dict[str, set[str]] = {
    "errors": set(), "choices": set(), "state": set(),
    "launch": {"errors"},
    "precision": {"errors"},
    "layout": {"choices", "errors"},
    # The torch-free part of models: the families' records, so that flags are checked before torch loads.
    "config": {"choices", "errors", "layout", "models"},
    "optim": {"config"},
    "mesh": {"choices", "errors", "launch", "layout"},
    "backends": {"choices", "errors", "launch", "precision"},
    "runtime": {"backends", "config", "errors", "launch", "layout", "mesh"},
    "data": {"choices", "config", "errors", "runtime"},
    "models": {"choices", "data", "errors"},
    "parallel": {"backends", "choices", "data", "errors", "layout", "mesh", "models", "optim", "precision", "runtime",
                 "state"},
    "checkpoint": {"config", "errors", "launch", "models", "optim", "runtime", "state"},
    "observe": {"backends", "config", "errors", "runtime"},
    "export": {"checkpoint", "errors", "models"},
}
CORE_OF_A_RUN = "training"  # imports any layer above


def _layer(module: str) -> str:
    return module.split(".")[1] if "." in module else module


def closure(graph: dict[str, set[str]], modules: list[str]) -> set[str]:
    """Every distlm module that loading ``modules`` loads."""
    seen, todo = set(), list(modules)
    while todo:
        for target in graph[todo.pop()]:
            if target not in seen:
                seen.add(target)
                todo.append(target)
    return seen


def test_each_layer_imports_only_the_layers_below_it():
    graph = import_graph()
    crossings = sorted(f"{module} -> {target}" for module, targets in graph.items() for target in targets
                       if _layer(module) in LAYERS and _layer(target) != _layer(module)
                       and _layer(target) not in LAYERS[_layer(module)])
    assert crossings == [], crossings
    training = {_layer(target) for module, targets in graph.items() if _layer(module) == CORE_OF_A_RUN
                for target in targets} - {CORE_OF_A_RUN}
    assert training <= set(LAYERS), sorted(training - set(LAYERS))


def test_what_needs_only_a_rank_loads_no_model_and_no_strategy():
    """The bare context imports only the launch, the mesh, the backends and the errors; the
    checkpoint and observe packages load neither the builder, nor Hugging Face conversion, nor
    a strategy. The message gives each package's count of modules loaded with it."""
    graph = import_graph()
    packages = sorted({_layer(module) for module in graph if "." in module})
    counts = {package: len(closure(graph, [m for m in graph if _layer(m) == package])) for package in packages}
    context = {_layer(module) for module in closure(graph, ["distlm.runtime.context"])}
    assert context <= {"launch", "mesh", "backends", "errors", "runtime", "choices", "precision", "layout"}, context
    for package in ("checkpoint", "observe"):
        loaded = closure(graph, [m for m in graph if _layer(m) == package])
        forbidden = sorted(m for m in loaded if m == "distlm.training.builder" or
                           m.startswith(("distlm.models.hf", "distlm.parallel")))
        assert forbidden == [], f"{package} loads {forbidden}; modules loaded per package: {counts}"


def test_the_cycle_finder_finds_a_cycle():
    assert import_cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


class NoInitWeights(torch.nn.Module):
    task = "causal_lm"
    max_positions = 64
    padding_idx = 1

    def forward(self, input_ids):
        return input_ids


def test_a_model_missing_part_of_the_contract_is_one_line_naming_it():
    with pytest.raises(UsageError) as caught:
        Trainer(parse_args(["--no-save"]), model=NoInitWeights())
    message = str(caught.value)
    assert "init_weights" in message and "\n" not in message
    assert "task" not in message.split("lacks ")[1].split(" of ")[0]  # only what is missing is named


_SYNCING = ("item", "tolist", "numpy", "cpu", "__float__", "__int__", "__bool__", "__index__")


@contextlib.contextmanager
def counting_host_syncs(counter: list[str], host_resident: set[int]):
    """Count every Tensor method that brings a value to the host (on CPU they do not block,
    on an accelerator each waits for the device), except on ``host_resident`` tensors
    (ids), which live on the host whatever the device."""
    originals = {name: getattr(torch.Tensor, name) for name in _SYNCING}

    def counted(name):
        original = originals[name]

        def wrapper(self, *args, **kwargs):
            if id(self) not in host_resident:
                counter.append(name)
            return original(self, *args, **kwargs)

        return wrapper

    for name in _SYNCING:
        setattr(torch.Tensor, name, counted(name))
    try:
        yield
    finally:
        for name, original in originals.items():
            setattr(torch.Tensor, name, original)


def host_syncs_per_update(args: list[str]) -> list[list[str]]:
    """The host synchronisations of two updates after the first (which allocates the
    optimizer's state), each a list of the Tensor methods that synchronised."""
    trainer = Trainer(parse_args(args))
    batches = trainer.update_batches()
    trainer.train_step(next(batches))
    # torch's AdamW keeps its step counters on the host (unless capturable), so reading
    # them never waits for a device.
    steps = {id(state["step"]) for state in trainer.optimizer.state.values()}
    per_update = []
    for _ in range(2):
        micro_batches = next(batches)  # prepared on the host before the update starts
        syncs: list[str] = []
        with counting_host_syncs(syncs, steps):
            trainer.train_step(micro_batches)
        per_update.append(syncs)
    return per_update


def host_syncs_of_layouts(layouts: list[list[str]]) -> list[list[list[str]]]:
    return [host_syncs_per_update(args) for args in layouts]


@pytest.mark.parametrize("extra", [[], ["--update-freq", "3"]], ids=["plain", "accumulating"])
def test_one_host_synchronisation_per_update(data_dir, tmp_path, extra):
    """The gradient norm's finite check is the one; the token count stays on the device
    and statistics wait for the log line."""
    for syncs in host_syncs_per_update(common_args(data_dir, str(tmp_path)) + ["--batch-size", "2", *extra]):
        assert len(syncs) <= 1, syncs


def test_one_host_synchronisation_per_update_under_every_strategy(data_dir, tmp_path):
    """The same on 2 ranks for ddp, fsdp and tensor parallel, whose global token count and
    gradient norm are collectives."""
    args = common_args(data_dir, str(tmp_path)) + ["--batch-size", "2"]
    layouts = [args, args + ["--strategy", "fsdp"], args + ["--tp-degree", "2"]]
    for rank in run_distributed(host_syncs_of_layouts, 2, layouts):
        for layout, per_update in zip(["ddp", "fsdp", "tp2"], rank):
            for syncs in per_update:
                assert len(syncs) <= 1, (layout, syncs)


def test_a_start_resolves_the_model_once(data_dir, tmp_path, monkeypatch):
    """Validation checks the spec of --arch before any rendezvous and hands it to the
    context; the trainer builds from that one, never resolving the settings again."""
    calls = []

    def counted(settings, tokens_per_sample=None):
        calls.append(settings.arch)
        return resolve_model_spec(settings, tokens_per_sample)

    monkeypatch.setattr(validation, "resolve_model_spec", counted)
    monkeypatch.setattr(trainer_module, "resolve_model_spec", counted)
    trainer = Trainer(parse_args(common_args(data_dir, str(tmp_path)) + ["--disable-validation"]))
    assert calls == ["roberta_tiny"] and trainer.spec.name == "roberta_tiny"


# Where a family's or a task's name may be compared: the family's own folder and the records
# that define the names; and the data pipeline, where each task's inputs are made (fairseq's
# masked_lm and language_modeling data differ). Everywhere else asks the family's record.
_NAMES_AT_HOME = ("distlm/models/family.py", "distlm/choices.py", "distlm/data/")


def family_and_task_branches(sources: dict[str, str] | None = None) -> list[str]:
    """``path:line`` of every comparison (``==``, ``!=``, ``in``, ``not in``) of a value with a
    family's name, a Hugging Face model_type distlm converts or a task's name, outside their
    homes (``sources``: path -> text; default every module of distlm)."""
    from distlm.models import registry
    from distlm.models.hf import ADAPTERS

    family_dirs = tuple(f"distlm/{package.removeprefix('distlm.').replace('.', '/')}/"
                        for package in registry.FAMILY_PACKAGES)
    names = set(registry.families()) | set(ADAPTERS) | set(choices.TASKS)
    if sources is None:
        sources = {path.relative_to(PACKAGE.parent).as_posix(): path.read_text() for path in sorted(PACKAGE.rglob("*.py"))}
    found = []
    for path, text in sources.items():
        if path.startswith(family_dirs + _NAMES_AT_HOME):
            continue
        for node in ast.walk(ast.parse(text)):
            if not isinstance(node, ast.Compare):
                continue
            for operand in [node.left, *node.comparators]:
                items = operand.elts if isinstance(operand, (ast.Tuple, ast.List, ast.Set)) else [operand]
                if any(isinstance(item, ast.Constant) and item.value in names for item in items):
                    found.append(f"{path}:{node.lineno}")
    return found


def test_no_family_or_task_name_is_branched_on_outside_its_home():
    assert family_and_task_branches() == []
    planted = 'def head_tokens(s, fraction):\n    return fraction if s.family == "roberta" else 1.0\n'
    assert family_and_task_branches({"distlm/plan/example.py": planted}) == ["distlm/plan/example.py:2"]
