"""The chat template a model brings: a GGUF file's ``tokenizer.chat_template`` key, or a Hugging
Face folder's ``chat_template.jinja`` (else the ``chat_template`` of its
``tokenizer_config.json``, the ``default`` one where it names several), the same order the head
reads a bundle's files in (docs/engine.md section 5.4).

None means the model has no template: it serves completions, and chat is refused for it by
whoever renders chat.  This module only reads; it never renders, never imports torch or
transformers, and never reads more of a GGUF file than its header.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from sfnode.engines import ModelLoadError
from sfnode.engines.weights.gguf import GgufFormatError, read_header

TEMPLATE_FILE = "chat_template.jinja"
GGUF_KEY = "tokenizer.chat_template"


def chat_template(source: Path) -> str | None:
    """The chat template of a GGUF file or a Hugging Face folder, or None when it has none.

    :raises ModelLoadError: the file or folder cannot be read.
    """
    if source.is_dir():
        return _folder_template(source)
    try:
        metadata, _ = read_header(source)
    except (OSError, GgufFormatError) as e:
        raise ModelLoadError(f"cannot read GGUF model {source}: {e}") from e
    return _template(metadata.get(GGUF_KEY))


def _folder_template(folder: Path) -> str | None:
    try:
        jinja = folder / TEMPLATE_FILE
        if jinja.is_file():
            return jinja.read_text()
        config_file = folder / "tokenizer_config.json"
        if not config_file.is_file():
            return None
        config = json.loads(config_file.read_text())
    except (OSError, ValueError) as e:
        raise ModelLoadError(f"cannot read the chat template of {folder}: {e}") from e
    return _template(config.get("chat_template") if isinstance(config, dict) else None)


def _template(value: Any) -> str | None:
    if isinstance(value, list):
        named = {t.get("name"): t.get("template") for t in value if isinstance(t, dict)}
        value = named.get("default")
    return value if isinstance(value, str) and value else None


__all__ = ["GGUF_KEY", "TEMPLATE_FILE", "chat_template"]
