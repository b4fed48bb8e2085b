"""``python -m sfnode COMMAND``: the small commands that are not the twistd plugins.

``token [--file PATH]`` prints the fleet token, creating the token file first (docs/protocol.md
section 5.4).  ``fleet [--engine mock] ...`` runs a head and one node on this machine (what
``make run`` runs; ``python -m sfnode fleet --help``).  ``top [--url URL]`` shows a head's
console in the terminal (``python -m sfnode top --help``).  ``model-files GGUF`` writes a GGUF
file's model files into the model cache and prints their folder (what a head runs in a child
process).  Installed, ``sfnode`` runs them too.
Nodes and heads themselves run under ``twistd sfnode`` / ``twistd sfhead``.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence

USAGE = (
    "usage: python -m sfnode token [--file PATH] | fleet [--help] | top [--help] "
    "| model-files GGUF"
)


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if not args or args[0] in ("-h", "--help"):
        print(USAGE)
        return 0 if args else 2
    if args[0] == "token":
        from sfnode.linkf.fleet_token import main as token_main

        return token_main(args[1:])
    if args[0] == "fleet":
        from sfnode.cli.launcher import main as fleet_main

        return fleet_main(args[1:])
    if args[0] == "top":
        from sfnode.cli.top import main as top_main

        return top_main(args[1:])
    if args[0] == "model-files":
        from sfnode.cli.model_files import main as model_files_main

        return model_files_main(args[1:])
    print(f"sfnode: unknown command {args[0]!r}\n{USAGE}", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
