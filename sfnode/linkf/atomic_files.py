"""Files written atomically: a temporary file beside the target, then one rename over it, so a
reader (another start, another process) sees the old file or the new one, never half of one.

Used by whatever a start keeps on disk for the next one: the stamps of a model file's hash
(``model_cache``), the kernel choice, the kernels' self-checks, the packed weights and the
check of exactness's digest (``sfnode.engines``).

This module must never create the target's folder (the caller decides where a file may go),
leave a temporary file behind when a write fails, or swallow the error.
"""

from __future__ import annotations

import json
import os
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any


@contextmanager
def replacing(path: Path) -> Iterator[Path]:
    """A temporary file's path beside ``path``, for the block to write; renamed over ``path``
    when the block ends, removed when the block or the rename raises (which goes on)."""
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    os.close(fd)
    try:
        yield Path(tmp)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def write_json(
    path: Path, value: Any, *, indent: int | None = None, sort_keys: bool = False
) -> None:
    """Write ``value`` as JSON to ``path`` atomically (:func:`replacing`)."""
    with replacing(path) as tmp:
        tmp.write_text(json.dumps(value, indent=indent, sort_keys=sort_keys))


__all__ = ["replacing", "write_json"]
