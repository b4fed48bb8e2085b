"""The package's shape (docs/architecture.md section 1): its layers, no import cycles, a
docstring on every module, and no class or function too big to read.

The layers are data in ``tests/layout.py``; ``python -m tests.layout`` prints what these tests
judge.
"""

from __future__ import annotations

import ast
import functools
from types import MappingProxyType

from twisted.trial.unittest import SynchronousTestCase

from tests import layout


@functools.cache
def parsed() -> MappingProxyType[str, layout.Module]:
    """Every module of sfnode, parsed once per test process (about 1 s) and read by every test
    here: no test changes the package's files, and none can change this mapping."""
    return MappingProxyType(layout.modules())


class LayerTests(SynchronousTestCase):
    def setUp(self) -> None:
        self.known = dict(parsed())

    def test_every_module_belongs_to_a_part(self) -> None:
        """Every module of sfnode falls in a part of the layer table, so a new folder cannot
        escape the rules by not being named in them."""
        for name in self.known:
            layout.part_of(name)

    def test_no_module_imports_against_the_layers(self) -> None:
        """No module imports a part of sfnode its own part may not (import-time and lazy
        imports alike)."""
        self.assertEqual(layout.violations(self.known), [])

    def test_the_judge_sees_a_violation(self) -> None:
        """The check itself finds an import against the layers: the wire core importing the
        head."""
        tree = ast.parse("from sfnode.head.api.http import OpenAIApi\n")
        fake = layout.Module("sfnode.linkf.fake", layout.PACKAGE / "linkf" / "fake.py", tree)
        found = layout.violations({**self.known, fake.name: fake})
        self.assertEqual(len(found), 1)
        self.assertIn("sfnode.linkf.fake imports sfnode.head.api.http", found[0])

    def test_no_import_cycles(self) -> None:
        """No two modules import each other, directly or around a loop, when imported."""
        self.assertEqual(layout.cycles(self.known), [])

    def test_a_cycle_is_found(self) -> None:
        """The cycle finder finds a loop of two modules."""
        one = layout.Module(
            "sfnode.linkf.one", layout.PACKAGE / "x.py", ast.parse("import sfnode.linkf.two\n")
        )
        two = layout.Module(
            "sfnode.linkf.two", layout.PACKAGE / "y.py", ast.parse("from sfnode.linkf import one\n")
        )
        self.assertEqual(
            layout.cycles({one.name: one, two.name: two}),
            [["sfnode.linkf.one", "sfnode.linkf.two"]],
        )

    def test_the_root_holds_only_the_design_cards_names(self) -> None:
        """``sfnode/`` itself holds only the package, its command and the three names the
        design card fixes; every other module lives in the folder of its concern."""
        self.assertEqual(
            layout.root_modules(),
            ["__init__.py", "__main__.py", "generation.py", "machines.py", "protocol.py"],
        )

    def test_the_design_cards_names_are_the_real_things(self) -> None:
        """``sfnode.protocol`` and ``sfnode.machines`` name the node's own protocol and
        machines, not copies."""
        from sfnode import machines, protocol
        from sfnode.node import machines as node_machines
        from sfnode.node import protocol as node_protocol

        self.assertIs(protocol.NodeProtocol, node_protocol.NodeProtocol)
        self.assertIs(protocol.NodeFactory, node_protocol.NodeFactory)
        self.assertIs(machines.SessionMachine, node_machines.SessionMachine)
        self.assertIs(machines.GenerationMachine, node_machines.GenerationMachine)


class ReadabilityTests(SynchronousTestCase):
    def setUp(self) -> None:
        self.known = dict(parsed())

    def test_every_module_says_what_it_is_for(self) -> None:
        """Every module starts with a docstring; every package's says what it may import."""
        for name, module in self.known.items():
            doc = ast.get_docstring(module.tree)
            self.assertTrue(doc, f"{name} has no module docstring")
            if module.is_package and name.count(".") >= 1:
                assert doc is not None
                self.assertIn("import", doc, f"{name}'s docstring does not say what it may import")

    def test_no_class_has_too_many_methods(self) -> None:
        """No class of sfnode defines more than 25 methods."""
        big = [s for s in layout.classes(self.known) if s.count > layout.MAX_METHODS]
        self.assertEqual(big, [])

    def test_no_function_is_too_long(self) -> None:
        """No function of sfnode is longer than 60 lines, docstring included."""
        long = [s for s in layout.functions(self.known) if s.count > layout.MAX_FUNCTION_LINES]
        self.assertEqual(long, [])
