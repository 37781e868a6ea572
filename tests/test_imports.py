"""lm's modules import each other without a circle, so any of them can be imported first.

Every `import lm...` and `from lm... import` counts, function-local ones too (not those under
`if TYPE_CHECKING:`, which never run): a local import that dodges a
circle at import time still ties the two modules together. Importing lm.a.b also runs lm/a/__init__.py, so
it counts as importing lm.a as well, except from inside lm.a.

    python tests/test_imports.py     # prints each module's imports of lm, dependencies first
"""

from __future__ import annotations

import ast
import graphlib
import os

import pytest

LM = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "lm")


def _modules() -> dict[str, str]:
    """{module name: path} for lm/*.py and lm/*/*.py."""
    found = {}
    for root, _, files in os.walk(LM):
        for name in files:
            if name.endswith(".py"):
                parts = os.path.relpath(os.path.join(root, name), os.path.dirname(LM))[:-3].split(os.sep)
                found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = os.path.join(root, name)
    return found


def _runtime_nodes(tree: ast.AST):
    """Every node of tree but those under `if TYPE_CHECKING:`, which never run."""
    for node in ast.iter_child_nodes(tree):
        if isinstance(node, ast.If) and getattr(node.test, "id", None) == "TYPE_CHECKING":
            yield from (n for child in node.orelse for n in [child, *_runtime_nodes(child)])
            continue
        yield node
        yield from _runtime_nodes(node)


def import_graph() -> dict[str, set[str]]:
    """{module: the lm modules it imports}."""
    modules = _modules()
    graph = {}
    for module, path in modules.items():
        with open(path, encoding="utf-8") as f:
            tree = ast.parse(f.read(), path)
        named = set()
        for node in _runtime_nodes(tree):
            if isinstance(node, ast.Import):
                named |= {alias.name for alias in node.names}
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                # `from lm.a import b` imports the module lm.a.b if there is one, else a name of lm.a.
                named |= {f"{node.module}.{alias.name}" for alias in node.names} | {node.module}
        imported = set()
        for name in named:
            parts = name.split(".")
            for end in range(2, len(parts) + 1):  # lm.a.b also runs lm/a/__init__.py
                target = ".".join(parts[:end])
                if target in modules and target != module and not module.startswith(target + "."):
                    imported.add(target)
        graph[module] = imported
    return graph


def test_lm_has_no_import_circle():
    graph = import_graph()
    assert {"lm.pretrained", "lm.hf", "lm.export", "lm.sampling", "lm.sampling.loop"} <= set(graph)
    list(graphlib.TopologicalSorter(graph).static_order())  # raises CycleError naming the circle


def test_a_circle_is_found():
    graph = import_graph()
    graph["lm.files"] = graph["lm.files"] | {"lm.config"}  # lm.config imports lm.files
    with pytest.raises(graphlib.CycleError):
        list(graphlib.TopologicalSorter(graph).static_order())


def test_hf_conversion_knows_no_checkpoints_runs_or_sampling():
    graph = import_graph()
    # (lm.chat: the chat template a tokenizer's files carry, which an export writes; lm.storage: the file layer
    # lm.files stands on, for a temporary name that fits)
    allowed = {"lm.chat", "lm.config", "lm.errors", "lm.files", "lm.model", "lm.storage", "lm.tokenizer"}
    hf_modules = [m for m in graph if m == "lm.hf" or m.startswith("lm.hf.")]
    assert len(hf_modules) > 1
    for module in hf_modules:
        assert {m for m in graph[module] if not m.startswith("lm.hf")} <= allowed, module


if __name__ == "__main__":
    graph = import_graph()
    for module in graphlib.TopologicalSorter(graph).static_order():
        print(f"{module:22} <- {', '.join(sorted(graph[module])) or '-'}")
    print(f"{len(graph)} modules, {sum(map(len, graph.values()))} imports, no circle")
