"""The generated option tables (docs/options.md, sfnode.cli.optiondocs) stay in step with --help.

Other branches add options to ``twistd sfnode`` and ``twistd sfhead``; each such change must
regenerate the tables with the one command the failure message names."""

from __future__ import annotations

import re
from pathlib import Path

from twisted.trial.unittest import SynchronousTestCase

from sfnode.cli import optiondocs

OPTIONS_MD = Path(__file__).resolve().parent.parent / "docs" / "options.md"


class OptionTableTests(SynchronousTestCase):
    def test_docs_options_md_is_what_the_options_generate(self) -> None:
        """docs/options.md is exactly what the two Options classes generate today: an option
        added, removed, re-documented or given another default without regenerating fails
        here, naming the command that regenerates the file."""
        written = OPTIONS_MD.read_text(encoding="utf-8") if OPTIONS_MD.exists() else ""
        if written != optiondocs.render():
            self.fail(
                "docs/options.md is out of step with the daemons' Options (what --help prints);"
                f" regenerate it from the repository's root with: {optiondocs.COMMAND}"
            )

    def test_every_option_of_help_has_a_row_with_its_default(self) -> None:
        """Each daemon's table lists exactly the options its ``--help`` prints (but
        --help and --version), and every ``[default: X]`` of --help is that row's default."""
        for program, options in optiondocs.daemons():
            helped = str(options)
            names = set(re.findall(r"^  (?:-\w, | {4})--([a-z0-9-]+)", helped, re.MULTILINE))
            rows = {row.name: row for row in optiondocs.rows(options)}
            self.assertEqual(set(rows), names - {"help", "version"}, program)
            flat = " ".join(helped.split())
            for row in rows.values():
                if row.default not in (None, ""):
                    self.assertIn(f"[default: {row.default}]", flat, (program, row.name))
            table = optiondocs.table(options)
            for name in rows:
                self.assertIn(f"`--{name}", table)
