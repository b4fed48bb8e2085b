"""A small mutation run: one-operator changes of the code, and whether the fast tests notice.

For each target module the script lists every place where one operator can be swapped (``<`` and
``<=``, ``==`` and ``!=``, ``+`` and ``-``, ``and`` and ``or``, ``True`` and ``False``, an integer
``n`` and ``n + 1``, ``not x`` and ``x``), draws a seeded sample of them, and for each one writes
the mutated module into a scratch copy of the checkout and runs the module's fast tests there.
A mutant is *killed* when the tests fail (or time out) and *survives* when they pass; the score is
killed / run.  Some survivors are equivalent mutants (no behaviour changed), so 100% is not the
goal; a survivor is a place to look at.

It never edits the checkout it runs from: mutants live only in the scratch copy (a temporary
folder, removed at the end), which is put first on ``PYTHONPATH``.  Every test run is under
``nice -n 19``.  The figures it prints are the report; nothing is asserted.

Usage: python bench/mutations.py [--per-module N] [--seed S] [--timeout SECONDS] [MODULE ...]
(MODULE is one of the targets below, e.g. sfnode/linkf/wire.py; all of them by default).
"""

from __future__ import annotations

import argparse
import ast
import os
import random
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

_SAMPLER_TESTS = ["tests.test_engine.SamplerTests", "tests.test_sampling.MockSamplerTests"]
TARGETS: dict[str, list[str]] = {
    "sfnode/decoding/sampler.py": _SAMPLER_TESTS,
    "sfnode/decoding/draws.py": _SAMPLER_TESTS,
    "sfnode/node/machines.py": [
        "tests.test_machines", "tests.test_fencing", "tests.test_drain.AgentDrainTests",
    ],
    "sfnode/linkf/wire.py": ["tests.test_wire"],
    "sfnode/engines/scheduling/scheduler.py": ["tests.test_scheduler"],
    "sfnode/engines/runners/llama.py": ["tests.test_engine"],
}  # fmt: skip
"""Each module mutated, and the fast test modules that should notice."""

_COMPARE_SWAPS: dict[type[ast.cmpop], type[ast.cmpop]] = {
    ast.Lt: ast.LtE, ast.LtE: ast.Lt, ast.Gt: ast.GtE, ast.GtE: ast.Gt,
    ast.Eq: ast.NotEq, ast.NotEq: ast.Eq, ast.In: ast.NotIn, ast.NotIn: ast.In,
    ast.Is: ast.IsNot, ast.IsNot: ast.Is,
}  # fmt: skip
_BINOP_SWAPS: dict[type[ast.operator], type[ast.operator]] = {
    ast.Add: ast.Sub, ast.Sub: ast.Add, ast.Mult: ast.FloorDiv, ast.FloorDiv: ast.Mult,
    ast.RShift: ast.LShift, ast.LShift: ast.RShift, ast.BitAnd: ast.BitOr,
}  # fmt: skip


@dataclass(frozen=True)
class Site:
    """One mutation: the n-th mutable node of a module (in ``ast.walk`` order) and how."""

    index: int
    line: int
    description: str


def _annotation_nodes(tree: ast.AST) -> set[int]:
    """ids of every node inside a type annotation (``int | None`` is not code to mutate)."""
    inside: set[int] = set()
    for node in ast.walk(tree):
        annotations: list[ast.expr | None] = []
        if isinstance(node, ast.AnnAssign):
            annotations.append(node.annotation)
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            annotations.append(node.returns)
            args = node.args
            for arg in [*args.posonlyargs, *args.args, *args.kwonlyargs, args.vararg, args.kwarg]:
                if arg is not None:
                    annotations.append(arg.annotation)
        for annotation in annotations:
            if annotation is not None:
                inside.update(id(n) for n in ast.walk(annotation))
    return inside


def _mutations(node: ast.AST) -> Iterator[str]:
    """What can be done to ``node``, as descriptions (at most one per node kind here)."""
    if isinstance(node, ast.Compare) and type(node.ops[0]) in _COMPARE_SWAPS:
        swapped = _COMPARE_SWAPS[type(node.ops[0])]
        yield f"{type(node.ops[0]).__name__} -> {swapped.__name__}"
    elif isinstance(node, ast.BinOp) and type(node.op) in _BINOP_SWAPS:
        yield f"{type(node.op).__name__} -> {_BINOP_SWAPS[type(node.op)].__name__}"
    elif isinstance(node, ast.BoolOp):
        yield "And -> Or" if isinstance(node.op, ast.And) else "Or -> And"
    elif isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.Not):
        yield "not x -> x"
    elif isinstance(node, ast.Constant) and isinstance(node.value, bool):
        yield f"{node.value} -> {not node.value}"
    elif isinstance(node, ast.Constant) and type(node.value) is int:
        yield f"{node.value} -> {node.value + 1}"


def sites(source: str) -> list[Site]:
    tree = ast.parse(source)
    skip = _annotation_nodes(tree)
    found = []
    for index, node in enumerate(ast.walk(tree)):
        if id(node) in skip:
            continue
        for description in _mutations(node):
            found.append(Site(index, getattr(node, "lineno", 0), description))
    return found


def mutate(source: str, site: Site) -> str:
    """``source`` with ``site`` applied (re-printed by ``ast.unparse``: comments are lost)."""
    tree = ast.parse(source)
    for index, node in enumerate(ast.walk(tree)):
        if index != site.index:
            continue
        if isinstance(node, ast.Compare):
            node.ops[0] = _COMPARE_SWAPS[type(node.ops[0])]()
        elif isinstance(node, ast.BinOp):
            node.op = _BINOP_SWAPS[type(node.op)]()
        elif isinstance(node, ast.BoolOp):
            node.op = ast.Or() if isinstance(node.op, ast.And) else ast.And()
        elif isinstance(node, ast.UnaryOp):
            return _drop_not(tree, node)
        elif isinstance(node, ast.Constant) and isinstance(node.value, bool):
            node.value = not node.value
        elif isinstance(node, ast.Constant):
            node.value = node.value + 1
        return ast.unparse(tree)
    raise ValueError(f"no node {site.index}")


def _drop_not(tree: ast.AST, target: ast.UnaryOp) -> str:
    class Drop(ast.NodeTransformer):
        def visit_UnaryOp(self, node: ast.UnaryOp) -> ast.AST:
            if node is target:
                return self.generic_visit(node.operand)
            return self.generic_visit(node)

    return ast.unparse(Drop().visit(tree))


def run_tests(copy: Path, tests: list[str], timeout: float) -> tuple[bool, float]:
    """(passed, seconds) of ``trial`` over ``tests`` in the scratch copy."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(copy), *filter(None, [env.get("PYTHONPATH")])])
    env.setdefault("HF_HUB_OFFLINE", "1")
    env.setdefault("TRANSFORMERS_OFFLINE", "1")
    env.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    started = time.monotonic()
    try:
        done = subprocess.run(
            ["nice", "-n", "19", sys.executable, "-m", "twisted.trial", *tests],
            cwd=copy,
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            timeout=timeout,
        )
    except subprocess.TimeoutExpired:
        return False, time.monotonic() - started
    return done.returncode == 0, time.monotonic() - started


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("modules", nargs="*", default=list(TARGETS))
    parser.add_argument("--per-module", type=int, default=12, help="mutants per module")
    parser.add_argument("--seed", type=int, default=15)
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds per test run")
    args = parser.parse_args()
    unknown = [m for m in args.modules if m not in TARGETS]
    if unknown:
        parser.error(f"not a target: {', '.join(unknown)} (targets: {', '.join(TARGETS)})")
    scratch = Path(tempfile.mkdtemp(prefix="sfnode-mutants-"))
    try:
        copy = scratch / "checkout"
        ignore = shutil.ignore_patterns(".venv", ".git", ".tox", "_trial_temp*")
        shutil.copytree(ROOT, copy, ignore=ignore)
        total_killed = total_run = 0
        for module in args.modules:
            tests = TARGETS[module]
            path = copy / module
            original = path.read_text()
            passed, seconds = run_tests(copy, tests, args.timeout)
            if not passed:
                print(f"{module}: the tests fail without a mutant; skipped")
                continue
            found = sites(original)
            count = min(args.per_module, len(found))
            chosen = sorted(random.Random(args.seed).sample(found, count), key=lambda s: s.line)
            print(f"{module}: {len(found)} mutation sites, {len(chosen)} run "
                  f"({' '.join(tests)}; unmutated {seconds:.1f} s)", flush=True)  # fmt: skip
            killed = 0
            for site in chosen:
                path.write_text(mutate(original, site))
                try:
                    passed, seconds = run_tests(copy, tests, args.timeout)
                finally:
                    path.write_text(original)
                killed += not passed
                verdict = "killed" if not passed else "SURVIVED"
                print(f"  line {site.line:4d} {site.description:<22} {verdict} ({seconds:.1f} s)",
                      flush=True)  # fmt: skip
            print(f"  score {killed}/{len(chosen)}", flush=True)
            total_killed += killed
            total_run += len(chosen)
        if total_run:
            print(f"total: {total_killed}/{total_run} killed "
                  f"({100.0 * total_killed / total_run:.0f}%)")  # fmt: skip
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
