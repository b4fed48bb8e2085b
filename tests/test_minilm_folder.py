"""The test suite's all-MiniLM-L6-v2 folder (``tests/embedders.py``'s ``minilm_folder``).

On a fresh machine both trial workers of ``make test`` may be first to need it; each must end
with the whole folder, and nothing half-extracted may stay behind.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from twisted.trial import unittest

from tests.embedders import MINILM_SKIP

ROOT = Path(__file__).resolve().parent.parent
EXTRACT = "from tests.embedders import minilm_folder; print(minilm_folder())"


class MinilmFolderTests(unittest.TestCase):
    skip = MINILM_SKIP

    def test_two_processes_extracting_at_once_both_get_the_folder(self) -> None:
        """Two processes with an empty cache at once, three times over: both print the
        folder, it holds the model, and no partial folder is left."""
        for attempt in range(3):
            home = Path(self.mktemp()).resolve() / f"home-{attempt}"
            home.mkdir(parents=True)
            env = {**os.environ, "HOME": str(home), "PYTHONPATH": str(ROOT)}
            children = [
                subprocess.Popen(
                    [sys.executable, "-c", EXTRACT],
                    env=env,
                    cwd=ROOT,
                    stdout=subprocess.PIPE,
                    stderr=subprocess.PIPE,
                )
                for _ in range(2)
            ]
            results = [child.communicate(timeout=120) for child in children]
            models = home / ".cache" / "sfnode" / "models"
            for child, (out, err) in zip(children, results, strict=True):
                self.assertEqual(child.returncode, 0, err.decode())
                self.assertEqual(Path(out.decode().strip()), models / "all-MiniLM-L6-v2")
            self.assertTrue((models / "all-MiniLM-L6-v2" / "model.safetensors").is_file())
            self.assertEqual([p.name for p in models.iterdir()], ["all-MiniLM-L6-v2"])
