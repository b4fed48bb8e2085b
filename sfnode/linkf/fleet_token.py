"""Fleet tokens (docs/protocol.md section 5.4): where the token file lives, how it is made, how it
is read.

A token is 64 lowercase hex characters from ``os.urandom(32)``.  The file is created
exclusively (``O_CREAT | O_EXCL``) with mode 0600 and never overwritten: when it exists its
token is used.  Reading trims ASCII whitespace; an empty file means "no token".  The token's
*text* is what both sides use: PSK = SHA-256(text) and ``Hello.auth`` = text.

``python -m sfnode token [--file PATH]`` prints the token, creating the file first if needed.
Without ``--file`` the path is ``$SFNODE_HOME/token`` when ``SFNODE_HOME`` is set, else
``~/.config/sfnode/token``.

This module never logs or prints a token by itself; only :func:`main` prints, because that is
what it is asked to do.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path

ASCII_WHITESPACE = b" \t\n\x0c\r"
"""What docs/protocol.md section 5.4 trims around a token (Rust's ``trim_ascii``: no vertical
tab)."""
TOKEN_BYTES = 32
HOME_VARIABLE = "SFNODE_HOME"


class TokenError(Exception):
    """The token file cannot be created or holds no token."""


def default_token_path(environ: Mapping[str, str] | None = None) -> Path:
    """``$SFNODE_HOME/token`` when ``SFNODE_HOME`` is set, else ``~/.config/sfnode/token``."""
    env = os.environ if environ is None else environ
    home = env.get(HOME_VARIABLE)
    if home:
        return Path(home).expanduser() / "token"
    return Path("~/.config/sfnode/token").expanduser()


def read_token(path: str | Path) -> bytes:
    """The fleet token in ``path``, trimmed of ASCII whitespace (docs/protocol.md section 5.4); b""
    means none.

    The one reader of token files: ``--auth-file`` on the node and on the head use it.

    :raises OSError: the file cannot be read.
    """
    return Path(path).expanduser().read_bytes().strip(ASCII_WHITESPACE)


def new_token() -> bytes:
    """A fresh token: 64 lowercase hex characters from the OS random source."""
    return os.urandom(TOKEN_BYTES).hex().encode("ascii")


def ensure_token(path: str | Path) -> tuple[bytes, bool]:
    """(the token in ``path``, whether it was created now).

    Creates the file exclusively with mode 0600 (its folder with 0700) when it does not exist;
    if another process created it meanwhile, theirs is used.  An existing file is never
    overwritten.

    :raises TokenError: the file exists but holds no token.
    :raises OSError: the file or its folder cannot be created or read.
    """
    target = Path(path).expanduser()
    target.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    token = new_token()
    try:
        fd = os.open(target, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:
        existing = read_token(target)
        if not existing:
            raise TokenError(
                f"{target} exists but holds no token; remove it to create one"
            ) from None
        return existing, False
    try:
        os.write(fd, token + b"\n")
        os.fsync(fd)
    finally:
        os.close(fd)
    return token, True


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m sfnode token [--file PATH]``: print the fleet token, creating it if needed."""
    parser = argparse.ArgumentParser(
        prog="python -m sfnode token",
        description="Print the fleet token, creating the token file (mode 0600) if it does not "
        "exist. An existing token is never overwritten.",
    )
    parser.add_argument(
        "--file",
        default=None,
        help=f"token file (default: ${HOME_VARIABLE}/token, else ~/.config/sfnode/token)",
    )
    args = parser.parse_args(argv)
    path = Path(args.file).expanduser() if args.file else default_token_path()
    try:
        token, created = ensure_token(path)
    except (TokenError, OSError) as e:
        print(f"sfnode token: {e}", file=sys.stderr)
        return 1
    print(f"{'created' if created else 'using the existing token in'} {path}", file=sys.stderr)
    print(token.decode("ascii"))
    return 0
