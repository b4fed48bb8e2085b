"""``python -m sfnode model-files GGUF``: write a GGUF file's model files (its tokenizer, chat
template and ``config.json``) into the model cache, as a node's first start does, and print their
folder.

A head that is given a GGUF file no node has converted yet runs this in a child process
(:func:`sfnode.head.tap.load_head_tokenizer`), so the conversion's imports (transformers, torch)
stay in that child and the head never maps them.  This module must never be imported by the head.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from pathlib import Path

USAGE = "usage: python -m sfnode model-files GGUF"


def main(args: Sequence[str]) -> int:
    if len(args) != 1 or args[0].startswith("-"):
        print(USAGE, file=sys.stderr)
        return 2
    from sfnode.engines.weights.loading import ModelLoadError, model_folder

    try:
        _, folder = model_folder(Path(args[0]).expanduser())
    except ModelLoadError as e:
        print(f"sfnode model-files: {e}", file=sys.stderr)
        return 1
    print(folder)
    return 0
