"""The head never maps torch or transformers (docs/architecture.md section 1): a real head
process, started on a GGUF file no node has converted yet, loads its tokenizer and chat template
and serves the model without importing either (the conversion runs in a child process of its
own, ``python -m sfnode model-files``); nor, until a constrained request needs them, the grammar
library and NumPy (docs/operating.md, "A light head")."""

from __future__ import annotations

import json
import os
import sys
import tempfile
from typing import Any

from twisted.internet import defer, reactor, utils
from twisted.trial import unittest

from tests import families
from tests.processes import REPO_ROOT, child_env

PROGRAM = """
import json, sys
from sfnode.head import tap
options = tap.Options()
options.parseOptions(["--http", "tcp:0:interface=127.0.0.1", "--node", "tcp:127.0.0.1:9",
                      "--model", sys.argv[1], "--model-name", "tiny"])
service = tap.makeService(options)
service.startService()
served = tap.head_models(options).get("tiny")
print(json.dumps({
    "modules": sorted(m for m in sys.modules if m.split(".")[0] in ("torch", "transformers")),
    "lazy": sorted(m for m in sys.modules if m.split(".")[0] in ("numpy", "llguidance")),
    "encoded": served.renderer.codec.encode("hello world", special=False),
}))
"""


class HeadImportsTests(unittest.TestCase):
    @defer.inlineCallbacks
    def test_a_head_on_an_unconverted_gguf_maps_no_torch(self) -> Any:
        """A head process given a GGUF file whose model files are not in its cache writes them
        through a child, serves the model's tokenizer (it encodes text as the model's own
        tokenizer does), and has imported neither torch nor transformers, nor the grammar
        library and NumPy (about 17 MB of the head's resident memory), which only a
        constrained request needs."""
        from tokenizers import Tokenizer

        path = families.gguf("qwen2", "Q8_0")
        cache = tempfile.mkdtemp(prefix="sfnode-head-imports-")
        env = dict(child_env(), XDG_CACHE_HOME=cache)
        out, err, status = yield utils.getProcessOutputAndValue(
            sys.executable, ["-c", PROGRAM, str(path)], env=env, path=str(REPO_ROOT),
            reactor=reactor,
        )  # fmt: skip
        self.assertEqual(status, 0, err.decode()[-2000:])
        found = json.loads(out.decode().strip().splitlines()[-1])
        self.assertEqual(found["modules"], [])
        self.assertEqual(found["lazy"], [])
        folders = [
            name for name in os.listdir(os.path.join(cache, "sfnode", "models"))
            if not name.startswith(".")
        ]  # fmt: skip
        self.assertEqual(len(folders), 1, folders)
        own = Tokenizer.from_file(str(families.folder("qwen2") / "tokenizer.json"))
        want = own.encode("hello world", add_special_tokens=False).ids
        self.assertEqual(found["encoded"], want)
        self.assertGreater(len(want), 1)
