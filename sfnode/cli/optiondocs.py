"""The option tables of ``twistd sfnode`` and ``twistd sfhead``, generated from their Options.

``python -m sfnode.cli.optiondocs > docs/options.md`` (from the repository's root, or ``make
options``) writes docs/options.md: for each daemon its synopsis, its description and one table
row per option, built from the same ``usage.Options`` data (``longOpt``, ``docs``, ``defaults``)
that ``--help`` prints.  tests/test_optiondocs.py fails when the file drifts from that data.

This module must never import torch or start anything: it only reads the two Options classes,
which are importable without the engine (the twistd plugins are lazy).
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from dataclasses import dataclass

from twisted.python import usage

COMMAND = "python -m sfnode.cli.optiondocs > docs/options.md"
"""The one command that regenerates docs/options.md (run from the repository's root)."""

_SKIPPED = frozenset({"help", "version"})


@dataclass(frozen=True, slots=True)
class Row:
    """One option as ``--help`` shows it."""

    name: str
    takes_value: bool
    default: str | None
    doc: str


def rows(options: usage.Options) -> list[Row]:
    """Every option of ``options`` (``--help`` and ``--version`` left out), by name."""
    found = []
    for spelled in options.longOpt:
        name = spelled.rstrip("=")
        if name in _SKIPPED:
            continue
        takes_value = spelled.endswith("=")
        default = options.defaults.get(name) if takes_value else None
        doc = " ".join((options.docs.get(name) or "").split())
        found.append(Row(name, takes_value, None if default is None else str(default), doc))
    return sorted(found, key=lambda row: row.name)


def _cell(text: str) -> str:
    return text.replace("|", "\\|")


def table(options: usage.Options) -> str:
    """The Markdown table of ``options``: option, default, what it does."""
    lines = ["| Option | Default | What it does |", "| --- | --- | --- |"]
    for row in rows(options):
        spelled = f"`--{row.name}=VALUE`" if row.takes_value else f"`--{row.name}`"
        default = f"`{_cell(row.default)}`" if row.default not in (None, "") else ""
        lines.append(f"| {spelled} | {default} | {_cell(row.doc)} |")
    return "\n".join(lines)


def section(program: str, options: usage.Options) -> str:
    synopsis = getattr(options, "synopsis", "") or "[options]"
    description = " ".join(str(getattr(options, "longdesc", "") or "").split())
    parts = [
        f"## `twistd {program}`",
        "",
        f"```\ntwistd [twistd options] {program} {synopsis}\n```",
    ]
    if description:
        parts += ["", description]
    parts += ["", table(options)]
    return "\n".join(parts)


def daemons() -> Sequence[tuple[str, usage.Options]]:
    """The two daemons and a fresh instance of each one's Options."""
    from sfnode.head.tap import Options as HeadOptions
    from sfnode.node.tap import Options as NodeOptions

    return [("sfnode", NodeOptions()), ("sfhead", HeadOptions())]  # type: ignore[no-untyped-call]


def render() -> str:
    """The whole of docs/options.md."""
    parts = [
        "# Options of `twistd sfnode` and `twistd sfhead`",
        "",
        "<!-- Generated from the daemons' Options classes; do not edit by hand.",
        f"     Regenerate: {COMMAND} -->",
        "",
        "Every option as `twistd sfnode --help` and `twistd sfhead --help` print it, with its "
        "default. How the head's options work together (queue, reconnect, prefix affinity, "
        "bounds, security) is told in [operating.md](operating.md).",
    ]
    for program, options in daemons():
        parts += ["", section(program, options)]
    return "\n".join(parts) + "\n"


def main(argv: Sequence[str] = ()) -> int:
    if argv:
        sys.stderr.write(f"usage: {COMMAND}\n")
        return 2
    sys.stdout.write(render())
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
