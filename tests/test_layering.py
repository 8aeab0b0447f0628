"""The package's layering: data flows one way through the request path the README lists.

0. The model, attention, quantization and kernels folders (the textbook) import nothing from the CPU wing
   `minfer/cpu/`: what they use of it reaches them through the platform seam (`minfer.platform`) and the
   objects it hands over (a `LinearMethod`, the fused ops, an attention backend's class, the quantized
   methods' `cpu_kernel`). The platform sits above what it chooses from: neither the CPU wing nor the model
   and attention folders import it (the loader, which builds it with the model, excepted), so no import
   circle runs through it.

1. Importing a lower layer (sampling, block manager, scheduler, sequence, tokenizer, detokenizer) loads no
   `minfer.model` module: checked in a fresh interpreter, from `sys.modules`.
2. No module imports one that sits earlier in the README's request flow ("each step is one call, and no
   step calls back into an earlier one"): checked on the import graph, read with `ast` from every file of
   `minfer/` (imports inside functions count; `if TYPE_CHECKING:` blocks do not). The steps and their
   modules are parsed from the README itself, so the list and the code cannot drift apart.

    pytest tests/test_layering.py
"""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PKG = ROOT / "minfer"

# Plain data and formulas every step may use; they import only each other.
SHARED = {"minfer.config", "minfer.sequence", "minfer.outputs", "minfer.sampling_params", "minfer.memory",
          "minfer.envs"}
# The seam that decides, once per worker, how this device runs a step (minfer/platform.py): every step may ask
# it, and it reaches the CPU wing only inside its functions, for the step that asks.
SEAM = {"minfer.platform", "minfer.extensions", "minfer.kv_cache_plan"}
# The CPU wing, and the folders that must reach it only through the seam.
WING = "minfer.cpu"
TEXTBOOK = ("minfer.model", "minfer.attention", "minfer.quantization", "minfer.kernels")
# What the platform chooses from, which must not ask it back: the wing, the model and attention folders. The
# loader builds the platform with the model it loads (it knows the dtype only once it read the checkpoint).
BELOW_SEAM = (WING, "minfer.model", "minfer.attention")
SEAM_BUILDERS = {"minfer.model.loader"}
# Entry points that drive the flow; they may import anything.
TOP = {"minfer", "minfer.llm", "minfer.engine", "minfer.step_hooks", "minfer.serve", "minfer.generate", "minfer.bench", "minfer.recap",
       "minfer.course",
       "minfer.eval", "minfer.quantize"}


def module_name(path: Path) -> str:
    rel = path.relative_to(ROOT).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _is_type_checking(node: ast.If) -> bool:
    t = node.test
    return (isinstance(t, ast.Name) and t.id == "TYPE_CHECKING") or (
        isinstance(t, ast.Attribute) and t.attr == "TYPE_CHECKING")


def imports_of(path: Path) -> set[str]:
    """Every `minfer...` module a file imports at run time (anywhere in it), as full dotted names."""
    tree = ast.parse(path.read_text(), str(path))
    me = module_name(path)
    package = me if path.name == "__init__.py" else me.rsplit(".", 1)[0]
    found: set[str] = set()

    def visit(node):
        if isinstance(node, ast.If) and _is_type_checking(node):
            for child in node.orelse:
                visit(child)
            return
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name.split(".")[0] == "minfer")
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[:len(base) - (node.level - 1)]
                mod = ".".join(base + ([node.module] if node.module else []))
            else:
                mod = node.module or ""
            if mod.split(".")[0] == "minfer":
                found.add(mod)
                found.update(f"{mod}.{a.name}" for a in node.names)  # `from minfer.x import module`
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(tree)
    known = {module_name(p) for p in PKG.rglob("*.py")}
    return {m for m in found if m in known and m != me}


def flow_from_readme() -> list[set[str]]:
    """The README's numbered request-flow list -> for each step, the module prefixes it names."""
    text = (ROOT / "README.md").read_text()
    section = text[text.index("One request moves through the code in one direction:"):]
    steps: list[str] = []
    for line in section.splitlines()[1:]:
        if re.match(r"^\d+\. ", line):
            steps.append(line)
        elif steps and line.startswith("   "):  # a wrapped item
            steps[-1] += " " + line.strip()
        elif steps:
            break
    flow = []
    for step in steps:
        paths = re.findall(r"`(minfer/[\w/]+(?:\.py)?)`", step)
        flow.append({p.removesuffix(".py").rstrip("/").replace("/", ".") for p in paths})
    return flow


def step_of(module: str, flow: list[set[str]]) -> int | None:
    for i, prefixes in enumerate(flow):
        if any(module == p or module.startswith(p + ".") for p in prefixes):
            return i
    return None


def violations(graph: dict[str, set[str]], flow: list[set[str]]) -> list[str]:
    """Edges that go back up the flow, or from shared data into the flow."""
    bad = []
    for mod, deps in sorted(graph.items()):
        if mod in TOP or mod in SEAM or any(mod.startswith(t + ".") for t in TOP if t != "minfer"):
            continue
        mine = step_of(mod, flow)
        for dep in sorted(deps):
            if dep in SEAM:
                continue
            theirs = step_of(dep, flow)
            if mod in SHARED and dep not in SHARED:
                bad.append(f"{mod} (shared data) imports {dep}")
            elif mine is not None and theirs is not None and theirs < mine:
                bad.append(f"{mod} (step {mine + 1}) imports {dep} (step {theirs + 1}), an earlier step")
            elif mine is not None and dep in TOP:
                bad.append(f"{mod} (step {mine + 1}) imports the entry point {dep}")
    return bad


def import_graph() -> dict[str, set[str]]:
    return {module_name(p): imports_of(p) for p in PKG.rglob("*.py")}


def test_readme_lists_the_flow_with_modules():
    flow = flow_from_readme()
    assert len([step for step in flow if step]) >= 8, flow
    for prefixes in flow:
        for p in prefixes:
            assert (ROOT / (p.replace(".", "/") + ".py")).is_file() or (ROOT / p.replace(".", "/")).is_dir(), p


def test_every_module_has_a_place():
    """A module outside the flow, the shared data and the entry points would escape the check."""
    flow = flow_from_readme()
    homeless = [m for m in import_graph() if m not in SHARED | SEAM and step_of(m, flow) is None
                and not (m in TOP or any(m.startswith(t + ".") for t in TOP if t != "minfer"))]
    assert not homeless, f"modules in no step of the README's request flow: {homeless}"


def wing_imports(graph: dict[str, set[str]]) -> list[str]:
    """Imports of the CPU wing from the textbook folders."""
    return [f"{mod} imports {dep}" for mod, deps in sorted(graph.items())
            if any(mod == t or mod.startswith(t + ".") for t in TEXTBOOK)
            for dep in sorted(deps) if dep == WING or dep.startswith(WING + ".")]


def test_textbook_folders_import_nothing_from_the_cpu_wing():
    assert wing_imports(import_graph()) == []


def test_the_wing_check_can_fail():
    assert wing_imports({"minfer.model.llama": {"minfer.cpu.decode_step"}})
    assert wing_imports({"minfer.quantization.base": {"minfer.cpu"}})
    assert not wing_imports({"minfer.model.llama": {"minfer.platform"}, "minfer.worker": {"minfer.cpu.malloc"}})
    src = "def f():\n    from minfer.cpu import qgemm\n"  # an import inside a function counts too
    path = PKG / "model" / "_wing_probe.py"
    try:
        path.write_text(src)
        assert wing_imports({"minfer.model._wing_probe": imports_of(path)})
    finally:
        path.unlink()


def _under(mod: str, prefixes) -> bool:
    return any(mod == p or mod.startswith(p + ".") for p in prefixes)


def seam_imports(graph: dict[str, set[str]]) -> list[str]:
    """Imports of the platform from what it chooses from (the CPU wing, model/, attention/)."""
    return [f"{mod} imports {dep}" for mod, deps in sorted(graph.items())
            if _under(mod, BELOW_SEAM) and mod not in SEAM_BUILDERS for dep in sorted(deps) if dep in SEAM]


def test_nothing_below_the_platform_imports_it():
    assert seam_imports(import_graph()) == []


def test_the_seam_check_can_fail():
    assert seam_imports({"minfer.cpu.build": {"minfer.platform"}})
    assert seam_imports({"minfer.attention.selector": {"minfer.platform"}})
    assert seam_imports({"minfer.model.layers": {"minfer.model.linear_method", "minfer.platform"}})
    assert not seam_imports({"minfer.model.loader": {"minfer.platform"}, "minfer.worker": {"minfer.platform"},
                             "minfer.platform": {"minfer.cpu.linear", "minfer.attention"}})
    src = "def f():\n    from minfer.platform import get_platform\n"  # a function-local import counts too
    path = PKG / "cpu" / "_seam_probe.py"
    try:
        path.write_text(src)
        assert seam_imports({"minfer.cpu._seam_probe": imports_of(path)})
    finally:
        path.unlink()


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The import graph's circles: its strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in graph.get(v, ()):
            if w not in graph:
                continue
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def seam_circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Circles through the platform, the CPU wing or the attention folder."""
    return [c for c in circles(graph) if any(m in SEAM or _under(m, (WING, "minfer.attention")) for m in c)]


def test_no_import_circle_runs_through_the_platform_the_wing_or_attention():
    assert seam_circles(import_graph()) == []


def test_the_circle_check_can_fail():
    graph = {"minfer.platform": {"minfer.cpu.build"}, "minfer.cpu.build": {"minfer.cpu.qgemm"},
             "minfer.cpu.qgemm": {"minfer.platform"}, "minfer.worker": {"minfer.platform"}}
    assert seam_circles(graph) == [["minfer.cpu.build", "minfer.cpu.qgemm", "minfer.platform"]]
    assert circles({"a": {"b"}, "b": {"c"}, "c": set()}) == []
    assert circles({"a": {"b"}, "b": {"a"}}) == [["a", "b"]]
    assert seam_circles({"minfer.model.gguf": {"minfer.model.loader"},
                         "minfer.model.loader": {"minfer.model.gguf"}}) == []  # not through the seam


def test_no_module_imports_an_earlier_step():
    assert violations(import_graph(), flow_from_readme()) == []


def test_the_check_can_fail():
    flow = [{"minfer.tokenizer"}, {"minfer.scheduler"}, {"minfer.model"}]
    assert violations({"minfer.model.llama": {"minfer.scheduler"}}, flow)
    assert violations({"minfer.sequence": {"minfer.tokenizer"}}, flow)
    assert not violations({"minfer.scheduler": {"minfer.model.llama", "minfer.sequence"}}, flow)
    src = "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from minfer.scheduler import X\n"
    path = PKG / "_layering_probe.py"
    try:
        path.write_text(src + "def f():\n    from minfer.engine import LLMEngine\n")
        assert imports_of(path) == {"minfer.engine"}
    finally:
        path.unlink()


@pytest.mark.parametrize("module", ["minfer.sampling", "minfer.block_manager", "minfer.scheduler",
                                    "minfer.sequence", "minfer.tokenizer", "minfer.detokenizer"])
def test_lower_layers_load_no_model_module(module):
    code = (f"import sys, {module}\n"
            "print(sorted(m for m in sys.modules if m == 'minfer.model' or m.startswith('minfer.model.')))")
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.strip() == "[]", f"importing {module} loaded {r.stdout.strip()}"


# The closed core (issue 38): what a learner steps through in one `LLM.generate`. Features attach from
# outside, through the seams (`SEAM`: the platform, the engine extensions, the KV cache's plan), so no core
# module imports a feature wing; tests/test_core_path.py checks that their code names none either.
CORE = {"minfer.llm", "minfer.engine", "minfer.scheduler", "minfer.block_manager", "minfer.prefix_cache",
        "minfer.sequence", "minfer.sampling_params", "minfer.sampling", "minfer.worker", "minfer.model_runner",
        "minfer.kv_cache",
        "minfer.tokenizer", "minfer.detokenizer", "minfer.attention.base", "minfer.model.llama",
        "minfer.model.layers", "minfer.model.positions"}
FEATURE_WINGS = ("minfer.spec_decode", "minfer.structured_output", "minfer.step_hooks", "minfer.beam_search",
                 "minfer.swap", "minfer.parallel", "minfer.kv_cache_groups", "minfer.attention.grouped",
                 "minfer.cpu")  # their settings (GuidedDecodingParams, BeamSearchParams) are shared data


def core_wing_imports(graph: dict[str, set[str]]) -> list[str]:
    """Imports of a feature wing by a core module."""
    return [f"{mod} imports {dep}" for mod, deps in sorted(graph.items()) if mod in CORE
            for dep in sorted(deps) if any(dep == w or dep.startswith(w + ".") for w in FEATURE_WINGS)]


def test_core_imports_no_feature_wing():
    graph = import_graph()
    assert CORE <= set(graph), sorted(CORE - set(graph))
    assert core_wing_imports(graph) == []


def test_the_core_check_can_fail():
    assert core_wing_imports({"minfer.engine": {"minfer.spec_decode.decoder"}})
    assert core_wing_imports({"minfer.scheduler": {"minfer.swap"}})
    assert not core_wing_imports({"minfer.engine": {"minfer.extensions"}, "minfer.swap": {"minfer.scheduler"}})
    path = PKG / "_core_probe.py"
    try:  # a function-level import is an import too
        path.write_text("def f():\n    from minfer.parallel.apply import parallelize\n")
        assert core_wing_imports({"minfer.worker": imports_of(path)})
    finally:
        path.unlink()
