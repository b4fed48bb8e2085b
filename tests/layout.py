"""The package's layers as data, and the figures of its shape (docs/architecture.md section 1).

``LAYERS`` says which parts of sfnode each part may import; :func:`violations` lists every import
that goes against it, :func:`cycles` every import cycle between modules, and :func:`sizes` the
largest classes and longest functions.  ``tests/test_layout.py`` holds the package to them, and
``python -m tests.layout`` prints the figures.

Read from the source with :mod:`ast` (nothing is imported or run), so the figures are the same
with or without torch installed.  An import under ``if TYPE_CHECKING:`` is a name for the type
checker, not a dependency, and is left out of both the layers and the cycles.
"""

from __future__ import annotations

import ast
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "sfnode"

_HEAD_API = frozenset(
    {
        "sfnode.head.fleet",
        "sfnode.head.models",
        "sfnode.head.link",
        "sfnode.linkf",
        "sfnode.runtime",
        "sfnode.generation",
        "sfnode.decoding",
        "sfnode.head.console",
    }
)
"""What the head's HTTP API may import (and the head's tap, with the API and discovery)."""

LAYERS: dict[str, frozenset[str]] = {
    # The shared core: what node and head must agree on; imports nothing of sfnode.
    "sfnode.linkf": frozenset(),
    "sfnode.runtime": frozenset({"sfnode.linkf"}),
    "sfnode.generation": frozenset({"sfnode.linkf"}),
    "sfnode.decoding": frozenset({"sfnode.linkf", "sfnode.generation"}),
    "sfnode.discovery": frozenset({"sfnode.linkf", "sfnode.runtime"}),
    # The engine: kernels at the bottom, the engine that joins them at the top.
    "sfnode.engines": frozenset({"sfnode.linkf", "sfnode.generation", "sfnode.decoding"}),
    "sfnode.engines.kernels": frozenset({"sfnode.engines", "sfnode.linkf"}),
    "sfnode.engines.families": frozenset({"sfnode.engines"}),
    "sfnode.engines.weights": frozenset(
        {"sfnode.engines", "sfnode.engines.kernels", "sfnode.engines.families", "sfnode.linkf"}
    ),
    "sfnode.engines.scheduling": frozenset(
        {"sfnode.engines", "sfnode.linkf", "sfnode.generation", "sfnode.decoding"}
    ),
    "sfnode.engines.runners": frozenset(
        {
            "sfnode.engines",
            "sfnode.engines.kernels",
            "sfnode.engines.families",
            "sfnode.engines.weights",
            "sfnode.engines.scheduling",
            "sfnode.linkf",
            "sfnode.generation",
            "sfnode.decoding",
        }
    ),
    # The loop every engine runs (the scheduler's steps sent to a runner), and the mock engine:
    # that loop with a pretend forward pass, torch-free.
    "sfnode.engines.loop": frozenset(
        {
            "sfnode.engines",
            "sfnode.engines.scheduling",
            "sfnode.linkf",
            "sfnode.generation",
            "sfnode.decoding",
        }
    ),
    "sfnode.engines.mock": frozenset(
        {
            "sfnode.engines",
            "sfnode.engines.loop",
            "sfnode.engines.scheduling",
            "sfnode.linkf",
            "sfnode.generation",
            "sfnode.decoding",
        }
    ),
    "sfnode.engines.transformers_engine": frozenset(
        {
            "sfnode.engines",
            "sfnode.engines.loop",
            "sfnode.engines.kernels",
            "sfnode.engines.families",
            "sfnode.engines.weights",
            "sfnode.engines.scheduling",
            "sfnode.engines.runners",
            "sfnode.linkf",
            "sfnode.generation",
            "sfnode.decoding",
        }
    ),
    # The node agent.  Only its command line chooses and builds an engine.
    "sfnode.node": frozenset(
        {"sfnode.linkf", "sfnode.runtime", "sfnode.generation", "sfnode.decoding"}
    ),
    "sfnode.node.tap": frozenset(
        {
            "sfnode.node",
            "sfnode.linkf",
            "sfnode.runtime",
            "sfnode.generation",
            "sfnode.decoding",
            "sfnode.discovery",
            "sfnode.engines",
            "sfnode.engines.weights",
            "sfnode.engines.scheduling",
            "sfnode.engines.mock",
            "sfnode.engines.transformers_engine",
        }
    ),
    # The head, bottom to top: its links, the models it serves, the fleet, the HTTP API.
    "sfnode.head": frozenset(),
    "sfnode.head.link": frozenset({"sfnode.linkf", "sfnode.runtime", "sfnode.generation"}),
    "sfnode.head.models": frozenset({"sfnode.linkf", "sfnode.runtime", "sfnode.decoding"}),
    "sfnode.head.fleet": frozenset(
        {"sfnode.head.link", "sfnode.head.models", "sfnode.linkf", "sfnode.generation"}
    ),
    # The operator's console: the fleet's figures, built on demand; the API serves them.
    "sfnode.head.console": frozenset(
        {
            "sfnode.head.fleet",
            "sfnode.head.link",
            "sfnode.head.models",
            "sfnode.linkf",
            "sfnode.runtime",
            "sfnode.generation",
        }
    ),
    "sfnode.head.api": _HEAD_API,
    "sfnode.head.tap": _HEAD_API | {"sfnode.head.api", "sfnode.discovery"},
    # The names the design card fixes, over the node's modules; and the top: commands.
    "sfnode.protocol": frozenset({"sfnode.node"}),
    "sfnode.machines": frozenset({"sfnode.node"}),
    "sfnode.cli": frozenset({"*"}),
    "sfnode.__main__": frozenset({"sfnode.cli", "sfnode.linkf"}),
    "sfnode": frozenset(),
}
"""Each part of sfnode (a package, or a module named on its own) and the parts it may import.
A module belongs to the longest part its name starts with; ``*`` allows everything."""

MAX_METHODS = 25
MAX_FUNCTION_LINES = 60


@dataclass(frozen=True)
class Module:
    name: str
    path: Path
    tree: ast.Module

    @property
    def is_package(self) -> bool:
        return self.path.name == "__init__.py"


def modules(root: Path = PACKAGE) -> dict[str, Module]:
    """Every module of the package, by dotted name."""
    found = {}
    for path in sorted(root.rglob("*.py")):
        parts = path.relative_to(root.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        found[name] = Module(name, path, ast.parse(path.read_text(), str(path)))
    return found


def _type_checking_only(tree: ast.Module) -> set[int]:
    """Line numbers of imports inside ``if TYPE_CHECKING:`` blocks."""
    lines: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            for inner in node.body:
                for sub in ast.walk(inner):
                    if isinstance(sub, ast.Import | ast.ImportFrom):
                        lines.add(sub.lineno)
    return lines


def imports(module: Module, known: dict[str, Module], *, top_level_only: bool) -> set[str]:
    """The sfnode modules ``module`` imports (a name imported from a package that is a module
    of it counts as that module); with ``top_level_only``, only the imports run at import time."""
    skip = _type_checking_only(module.tree)
    nodes: Iterator[ast.AST]
    if top_level_only:
        nodes = (n for stmt in module.tree.body for n in ast.walk(stmt) if _at_import_time(stmt))
    else:
        nodes = ast.walk(module.tree)
    found: set[str] = set()
    for node in nodes:
        if getattr(node, "lineno", None) in skip:
            continue
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            for alias in node.names:
                full = f"{node.module}.{alias.name}"
                target = full if full in known else node.module
                if target.startswith("sfnode"):
                    found.add(target)
        elif isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name.startswith("sfnode"))
    found.discard(module.name)
    return found


def _at_import_time(stmt: ast.stmt) -> bool:
    return not isinstance(stmt, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef) or (
        isinstance(stmt, ast.ClassDef)
    )


def part_of(name: str) -> str:
    """The part of :data:`LAYERS` a module belongs to."""
    best = ""
    for part in LAYERS:
        if (name == part or name.startswith(part + ".")) and len(part) > len(best):
            best = part
    if not best:
        raise KeyError(f"{name} belongs to no part of LAYERS (tests/layout.py)")
    return best


def violations(known: dict[str, Module] | None = None) -> list[str]:
    """Every import of one part of sfnode by another that :data:`LAYERS` does not allow."""
    known = modules() if known is None else known
    found = []
    for name, module in known.items():
        mine = part_of(name)
        allowed = LAYERS[mine]
        for target in sorted(imports(module, known, top_level_only=False)):
            theirs = part_of(target)
            if theirs == mine or "*" in allowed or theirs in allowed:
                continue
            if name.startswith(theirs + "."):
                # A module may import the package it lives in (its constants, its docstring).
                continue
            found.append(f"{name} imports {target} ({mine} may not import {theirs})")
    return found


def cycles(known: dict[str, Module] | None = None) -> list[list[str]]:
    """The import cycles between modules (strongly connected components of more than one
    module, or a module importing itself), counting imports run at import time."""
    known = modules() if known is None else known
    graph = {n: imports(m, known, top_level_only=True) & known.keys() for n, m in known.items()}
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    counter = [0]

    def visit(node: str) -> None:
        index[node] = low[node] = counter[0]
        counter[0] += 1
        stack.append(node)
        on_stack.add(node)
        for target in graph[node]:
            if target not in index:
                visit(target)
                low[node] = min(low[node], low[target])
            elif target in on_stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            component = []
            while True:
                top = stack.pop()
                on_stack.discard(top)
                component.append(top)
                if top == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    sys.setrecursionlimit(max(sys.getrecursionlimit(), 10_000))
    for node in graph:
        if node not in index:
            visit(node)
    return found


@dataclass(frozen=True)
class Size:
    where: str
    count: int


def classes(known: dict[str, Module] | None = None) -> list[Size]:
    """Every class with the number of functions defined in its body, largest first."""
    known = modules() if known is None else known
    found = []
    for name, module in known.items():
        for node in ast.walk(module.tree):
            if isinstance(node, ast.ClassDef):
                count = sum(
                    isinstance(s, ast.FunctionDef | ast.AsyncFunctionDef) for s in node.body
                )
                found.append(Size(f"{name}.{node.name}", count))
    return sorted(found, key=lambda s: -s.count)


def functions(known: dict[str, Module] | None = None) -> list[Size]:
    """Every function (methods and nested functions included) with its length in lines,
    decorators and docstring included, longest first."""
    known = modules() if known is None else known
    found = []
    for name, module in known.items():
        for node in ast.walk(module.tree):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                assert node.end_lineno is not None
                first = min([node.lineno, *(d.lineno for d in node.decorator_list)])
                found.append(Size(f"{name}:{node.lineno} {node.name}", node.end_lineno - first + 1))
    return sorted(found, key=lambda s: -s.count)


def root_modules(root: Path = PACKAGE) -> list[str]:
    """The modules directly in ``sfnode/``."""
    return sorted(p.name for p in root.glob("*.py"))


def main() -> int:
    known = modules()
    found_cycles = cycles(known)
    found_violations = violations(known)
    biggest = classes(known)[:5]
    longest = functions(known)[:5]
    print(
        f"modules: {len(known)}; at the package root: {len(root_modules())} "
        f"({', '.join(root_modules())})"
    )
    print(f"import cycles: {len(found_cycles)}")
    for cycle in found_cycles:
        print("  " + " <-> ".join(cycle))
    print(f"imports against the layers: {len(found_violations)}")
    for line in found_violations:
        print("  " + line)
    print(f"largest classes (methods; at most {MAX_METHODS}):")
    for size in biggest:
        print(f"  {size.count:4d}  {size.where}")
    print(f"longest functions (lines; at most {MAX_FUNCTION_LINES}):")
    for size in longest:
        print(f"  {size.count:4d}  {size.where}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
