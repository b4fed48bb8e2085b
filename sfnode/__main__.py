"""``python -m sfnode COMMAND``: the small commands that are not the twistd plugins.

``token [--file PATH]`` prints the fleet token, creating the token file first (docs/protocol.md
section 5.4).
Nodes and heads themselves run under ``twistd sfnode`` / ``twistd sfhead``.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence

USAGE = "usage: python -m sfnode token [--file PATH]"


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if not args or args[0] in ("-h", "--help"):
        print(USAGE)
        return 0 if args else 2
    if args[0] == "token":
        from sfnode.tokens import main as token_main

        return token_main(args[1:])
    print(f"sfnode: unknown command {args[0]!r}\n{USAGE}", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
