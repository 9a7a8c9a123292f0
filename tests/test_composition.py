"""How the engine is composed, read from the source: one EngineConfig passed down (no function on
the build path takes a long keyword list), no pipeline named outside the registry (nothing
branches on a pipeline's name in the service, the engine core or the composition root; the
service never probes the engine with getattr), and a pipeline's parts built with what they need
(no adapter sets an attribute of a part it built: a source, a frame coder), and the engines root
holding only its faces (contract, build, config; every other module in the subpackage of its
layer). Each check reads the real tree; the cases at the bottom run each checker on a snippet that breaks its rule, so none can pass for nothing."""

from __future__ import annotations

import ast
import inspect
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
MAX_PARAMETERS = 8
# what the engines root holds: the interface, the composition root and the config the settings build
ENGINES_FACES = {"__init__.py", "contract.py", "build.py", "config.py"}


def sources(*parts: str) -> list[Path]:
    out: list[Path] = []
    for part in parts:
        path = ROOT / part
        out += sorted(path.rglob("*.py")) if path.is_dir() else [path]
    return out


def pipeline_branches(text: str, names: set[str]) -> list[str]:
    """Comparisons (==, !=, in, not in) against a string that names a pipeline (``"talker"``,
    ``"talker steps"``): a branch on which pipeline runs."""
    found = []
    for node in ast.walk(ast.parse(text)):
        if isinstance(node, ast.Compare):
            for const in ast.walk(node):
                if isinstance(const, ast.Constant) and isinstance(const.value, str) and (
                        names & set(re.findall(r"\w+", const.value.lower()))):
                    found.append(f"{node.lineno}: {ast.unparse(node)}")
    return found


def engine_probes(text: str) -> list[str]:
    """``getattr(<something engine>, ...)``: asking the engine what it is instead of its contract."""
    return [f"{node.lineno}: {ast.unparse(node)}" for node in ast.walk(ast.parse(text))
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "getattr"
            and node.args and "engine" in ast.unparse(node.args[0]).lower()]


def own_nodes(scope: ast.AST):
    """The nodes of one function (or module) body, not of the functions and classes inside it."""
    for child in ast.iter_child_nodes(scope):
        yield child
        if not isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda, ast.ClassDef)):
            yield from own_nodes(child)


def part_patches(text: str) -> list[str]:
    """Assignments to an attribute of a part the code built: a name bound to a call's result in the
    same function (``coder = FrameCoder(...)``, then ``coder.predictor = ...``), or any ``source``
    (``source.x = ...``, ``source.prefill.runner = ...``)."""
    found = []
    for scope in ast.walk(ast.parse(text)):
        if not isinstance(scope, (ast.Module, ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        nodes = list(own_nodes(scope))
        calls = [node for node in nodes if isinstance(node, ast.Assign) and isinstance(node.value, ast.Call)]
        built = {"source"} | {name.id for node in calls for target in node.targets
                              for name in (target.elts if isinstance(target, ast.Tuple) else [target])
                              if isinstance(name, ast.Name)}
        for node in nodes:
            targets = node.targets if isinstance(node, ast.Assign) else [node.target] if isinstance(
                node, (ast.AugAssign, ast.AnnAssign)) else []
            for target in targets:
                base = target
                while isinstance(base, ast.Attribute):
                    base = base.value
                if isinstance(target, ast.Attribute) and isinstance(base, ast.Name) and base.id in built:
                    found.append(f"{node.lineno}: {ast.unparse(target)}")
    return found


def too_many_parameters(function) -> int | None:
    """The parameter count of ``function`` (self excluded) when it is over MAX_PARAMETERS."""
    count = len([p for p in inspect.signature(function).parameters if p != "self"])
    return count if count > MAX_PARAMETERS else None


def registered_names() -> set[str]:
    from engines.pipelines.registry import PIPELINES

    return set(PIPELINES)


def test_nothing_branches_on_a_pipeline_name_outside_the_registry():
    names = registered_names()
    found = [f"{path.relative_to(ROOT)}:{hit}" for path in sources("service", "engines/core", "engines/build.py")
             for hit in pipeline_branches(path.read_text(), names)]
    assert not found, "\n".join(found)


def test_the_service_never_probes_the_engine_with_getattr():
    found = [f"{path.relative_to(ROOT)}:{hit}" for path in sources("service")
             for hit in engine_probes(path.read_text())]
    assert not found, "\n".join(found)


def test_no_adapter_sets_an_attribute_of_a_part_it_built():
    """Each adapter (the talker's, the DiT's, the virtual device's) hands a source or a frame coder
    its runners at construction; none patches one afterwards."""
    adapters = [*sorted((ROOT / "engines/pipelines").glob("*/adapter.py")), ROOT / "engines/virtual/device.py"]
    assert {"talker", "dit"} <= {path.parent.name for path in adapters}
    found = [f"{path.relative_to(ROOT)}:{hit}" for path in adapters for hit in part_patches(path.read_text())]
    assert not found, "\n".join(found)


def test_the_engines_root_holds_only_its_faces():
    others = sorted(p.name for p in (ROOT / "engines").glob("*.py") if p.name not in ENGINES_FACES)
    assert not others, f"engines/{others} belong in the subpackage of their layer (pyproject's engine-layers)"


def test_no_function_on_the_build_path_takes_a_long_parameter_list():
    """The settings build one EngineConfig; build_engine, the engine, its worker, the registry's
    loaders and builders and the talker source's runners take it (or a part of it), not a keyword each."""
    from engines import build
    from engines.core.engine import Engine
    from engines.core.worker import Worker
    from engines.pipelines.profile import PipelineSetup
    from engines.pipelines.registry import PIPELINES
    from engines.pipelines.talker import adapter as talker
    from engines.virtual.device import VirtualDevice
    from service.server import build_engine_for
    from service.settings import Settings

    path = [build.build_engine, build.resolve_config, build.load_aligner, build.cpu_threads, Engine.__init__,
            Worker.__init__, PipelineSetup, talker.real_source, talker.source_runners, VirtualDevice.model_parts,
            VirtualDevice.build_pipeline, build_engine_for, Settings.engine_config]
    path += [f for registration in PIPELINES.values() for f in (registration.load, registration.build)]
    long = {f.__qualname__: n for f in path if (n := too_many_parameters(f))}
    assert not long, long


@pytest.mark.parametrize("checker, snippet", [
    (lambda t: pipeline_branches(t, {"talker", "dit"}), 'if source == "talker":\n    pass'),
    (lambda t: pipeline_branches(t, {"talker", "dit"}), 'talker = plan.step_unit == "talker steps"'),
    (lambda t: pipeline_branches(t, {"talker", "dit"}), 'ok = source not in (None, "talker")'),
    (engine_probes, 'captures = getattr(self.engine, "graph_captures_after_start", None)'),
    (part_patches, "source.batched_admission = False"),
    (part_patches, "source.prefill.runner = GraphedPrefill(source.prefill_spec())"),
    (part_patches, "def build(setup):\n    coder = FrameCoder(head, predictor, device)\n"
                   "    coder.predictor = GraphedCodePredictor(coder.predictor)"),
    (lambda t: [too_many_parameters(eval(t))] if too_many_parameters(eval(t)) else [],  # noqa: S307
     "lambda a, b, c, d, e, f, g, h, i: None"),
], ids=["name-compare", "unit-compare", "name-in-tuple", "getattr-engine", "source-attr", "source-part-attr",
        "built-part-attr", "nine-params"])
def test_each_checker_finds_what_breaks_its_rule(checker, snippet):
    assert checker(snippet)
