"""Which grammar library sfnode constrains output with: llguidance and xgrammar side by side on
the bundled model's tokenizer (SmolLM2, 49,152 tokens), as docs/engine.md section 2.4 reports.

For each library, in a process of its own (so that memory and imports are its own):

- whether importing it imports torch (the head compiles schemas to answer 400s, and the head
  must never import torch);
- building its view of the vocabulary;
- compiling the nested JSON schema of the targets (tests/agents.py) and a tools grammar
  (three tools, ``tool_choice`` required: ``<tool_call>`` JSON ``</tool_call>``; and auto:
  free text, then a call once ``<tool_call>`` is written), with the library's cache off;
- computing the allowed-token mask along a valid answer, per token, for one lane and for 8
  lanes at once (the library's own parallel call);
- the memory the process grew by (vocabulary, grammars and 8 matchers);
- correctness: the valid answers are accepted token by token and may end only at their end;
  answers that break the schema (a value outside an enum, an integer out of bounds, too many
  items, a missing key, an extra key) are refused at the token that breaks it; and random
  walks (a seeded uniform pick among the allowed tokens, up to 400 tokens) end in JSON that
  validates (``jsonschema``).

xgrammar is not a dependency of sfnode: install it into a scratch environment with
``pip install --no-deps xgrammar apache-tvm-ffi`` (its declared dependencies pull triton); the
script says so and measures llguidance alone when it is missing.

    PYTHONPATH=. python bench/grammar.py
    PYTHONPATH=. python bench/grammar.py --walks 40

This script only measures and prints; it must never assert or be imported by the package.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")

LIBRARIES = ("llguidance", "xgrammar")
BAD_ANSWERS = {
    "enum": '{"city": "Paris", "country": "Mars"',
    "integer bound": '{"city": "Paris", "country": "France", "population_millions": 41',
    "maxItems": (
        '{"city": "Paris", "country": "France", "population_millions": 2, '
        '"landmarks": ["a", "b", "c", "d"'
    ),
    "missing key": '{"city": "Paris", "population_millions": 2',
    "extra key": '{"city": "Paris", "mayor": "x"',
}


def tool_schema() -> dict[str, Any]:
    """The JSON of one call of tests/agents.py's tools, as an anyOf over the tools."""
    from tests.agents import TOOLS

    return {
        "anyOf": [
            {
                "type": "object",
                "properties": {
                    "name": {"const": t["function"]["name"]},
                    "arguments": t["function"]["parameters"],
                },
                "required": ["name", "arguments"],
                "additionalProperties": False,
            }
            for t in TOOLS
        ]
    }


class Library:
    """One library behind the few calls this script makes."""

    name = ""

    def matcher(self, grammar: str) -> Any: ...

    def compile(self, grammar: str) -> Any: ...

    def fill(self, matchers: list[Any]) -> Any: ...

    def allowed(self, masks: Any, row: int) -> set[int]: ...

    def consume(self, matcher: Any, token: int) -> bool: ...

    def accepting(self, matcher: Any) -> bool: ...


class Llguidance(Library):
    name = "llguidance"

    def __init__(self, tokenizer_json: str, size: int, eos: int) -> None:
        from sfnode.decoding.constraint import Vocabulary

        self.vocabulary = Vocabulary(tokenizer_json, size=size, eos_ids=[eos])
        import llguidance

        self.executor = llguidance.LLExecutor(num_threads=1)

    def grammars(self) -> dict[str, Any]:
        from sfnode.decoding.constraint import response_format_grammar, tools_grammar
        from tests.agents import NESTED_SCHEMA, TOOLS

        return {
            "nested schema": response_format_grammar(
                {"type": "json_schema", "json_schema": {"name": "x", "schema": NESTED_SCHEMA}}
            ),
            "tools required": tools_grammar(TOOLS, "required", False),
            "tools auto": tools_grammar(TOOLS, "auto", False),
        }

    def compile(self, grammar: Any) -> Any:
        return self.matcher(grammar)

    def matcher(self, grammar: Any) -> Any:
        from sfnode.decoding.constraint import Matcher

        return Matcher(self.vocabulary, grammar)

    def fill(self, matchers: list[Any]) -> Any:
        import llguidance.numpy

        masks = self.vocabulary.new_masks(len(matchers))
        if len(matchers) == 1:
            llguidance.numpy.fill_next_token_bitmask(matchers[0]._matcher, masks, 0)
        else:
            llguidance.numpy.fill_next_token_bitmask_par(
                self.executor, [(m._matcher, i) for i, m in enumerate(matchers)], masks
            )
        return masks

    def allowed(self, masks: Any, row: int) -> set[int]:
        return {int(t) for t in self.vocabulary.allowed(masks, row)}

    def consume(self, matcher: Any, token: int) -> bool:
        return bool(matcher._matcher.consume_token(token))

    def accepting(self, matcher: Any) -> bool:
        return bool(matcher.accepting)


class Xgrammar(Library):
    name = "xgrammar"

    def __init__(self, tokenizer: Any, size: int, eos: int) -> None:
        import xgrammar

        self.xgr = xgrammar
        self.size = size
        self.info = xgrammar.TokenizerInfo.from_huggingface(
            tokenizer, vocab_size=size, stop_token_ids=[eos]
        )
        self.compiler = xgrammar.GrammarCompiler(self.info, max_threads=1, cache_enabled=False)
        self.batch = xgrammar.BatchGrammarMatcher(max_threads=1)

    def grammars(self) -> dict[str, Any]:
        from tests.agents import NESTED_SCHEMA

        xgr = self.xgr
        separators = (", ", ": ")
        call = xgr.Grammar.from_json_schema(
            json.dumps(tool_schema()), any_whitespace=False, separators=separators
        )
        required = xgr.Grammar.concat(
            xgr.Grammar.from_ebnf('root ::= "<tool_call>"'),
            call,
            xgr.Grammar.from_ebnf('root ::= "</tool_call>"'),
        )
        tag = xgr.StructuralTagItem(
            begin="<tool_call>", schema=json.dumps(tool_schema()), end="</tool_call>"
        )
        return {
            "nested schema": ("schema", json.dumps(NESTED_SCHEMA)),
            "tools required": ("grammar", required),
            "tools auto": ("tag", tag),
        }

    def compile(self, grammar: Any) -> Any:
        kind, value = grammar
        if kind == "schema":
            return self.compiler.compile_json_schema(
                value, any_whitespace=False, separators=(", ", ": ")
            )
        if kind == "grammar":
            return self.compiler.compile_grammar(value)
        return self.compiler.compile_structural_tag([value], ["<tool_call>"])

    def matcher(self, grammar: Any) -> Any:
        return self.xgr.GrammarMatcher(self.compile(grammar))

    def fill(self, matchers: list[Any]) -> Any:
        masks = self.xgr.allocate_token_bitmask(len(matchers), self.size)
        if len(matchers) == 1:
            matchers[0].fill_next_token_bitmask(masks, 0)
        else:
            self.batch.batch_fill_next_token_bitmask(matchers, masks)
        return masks

    def allowed(self, masks: Any, row: int) -> set[int]:
        import numpy as np

        bits = np.unpackbits(masks[row].numpy().view(np.uint8), bitorder="little")[: self.size]
        return {int(t) for t in np.flatnonzero(bits)}

    def consume(self, matcher: Any, token: int) -> bool:
        return bool(matcher.accept_token(token))

    def accepting(self, matcher: Any) -> bool:
        return bool(matcher.is_completed())


def median_us(f: Callable[[], Any], n: int) -> float:
    times = []
    for _ in range(n):
        started = time.perf_counter()
        f()
        times.append(time.perf_counter() - started)
    return statistics.median(times) * 1e6


def rss_mb() -> float:
    import psutil

    return float(psutil.Process().memory_info().rss) / 2**20


def measure(name: str, walks: int) -> dict[str, Any]:
    """Every figure of one library, in this process."""
    import jsonschema

    from sfnode.engines.weights import loading
    from tests.agents import NESTED_INSTANCE, NESTED_SCHEMA, TOOL_CALL_INSTANCE

    out: dict[str, Any] = {}
    before = set(sys.modules)
    started = time.perf_counter()
    __import__(name)
    out["import s"] = time.perf_counter() - started
    out["imports torch"] = "torch" in set(sys.modules) - before
    tokenizer = loading.load_tokenizer(None)
    size, eos = 49152, int(tokenizer.eos_token_id)
    base = rss_mb()
    started = time.perf_counter()
    library: Library
    if name == "llguidance":
        library = Llguidance(tokenizer.backend_tokenizer.to_str(), size, eos)
    else:
        library = Xgrammar(tokenizer, size, eos)
    out["vocabulary s"] = time.perf_counter() - started
    grammars = library.grammars()  # type: ignore[attr-defined]
    for label, grammar in grammars.items():
        out[f"compile {label} ms"] = median_us(lambda g=grammar: library.compile(g), 5) / 1000
    encode = tokenizer.encode
    answers = {"nested schema": NESTED_INSTANCE, "tools required": TOOL_CALL_INSTANCE}
    for label, text in answers.items():
        tokens = encode(text, add_special_tokens=False)
        single, batched, ok = [], [], True
        one = library.matcher(grammars[label])
        eight = [library.matcher(grammars[label]) for _ in range(8)]
        for token in tokens:
            started = time.perf_counter()
            masks = library.fill([one])
            single.append(time.perf_counter() - started)
            started = time.perf_counter()
            library.fill(eight)
            batched.append(time.perf_counter() - started)
            allowed = library.allowed(masks, 0)
            ok &= token in allowed and eos not in allowed
            ok &= library.consume(one, token) and all(library.consume(m, token) for m in eight)
        final = library.allowed(library.fill([one]), 0)
        ok &= library.accepting(one) and eos in final
        out[f"mask {label} us/token"] = statistics.median(single) * 1e6
        out[f"mask 8 lanes {label} us/step"] = statistics.median(batched) * 1e6
        out[f"accepts {label}"] = ok
    out["memory MB"] = rss_mb() - base
    refused = 0
    for text in BAD_ANSWERS.values():
        matcher = library.matcher(grammars["nested schema"])
        tokens = encode(text, add_special_tokens=False)
        refused += not all(library.consume(matcher, t) for t in tokens)
    out["bad answers refused"] = f"{refused}/{len(BAD_ANSWERS)}"
    rng = random.Random(21)
    valid = 0
    for _ in range(walks):
        matcher = library.matcher(grammars["nested schema"])
        produced: list[int] = []
        for _ in range(400):
            allowed = sorted(library.allowed(library.fill([matcher]), 0))
            token = rng.choice(allowed)
            if token == eos:
                break
            if not library.consume(matcher, token):
                break
            produced.append(token)
        try:
            jsonschema.validate(json.loads(tokenizer.decode(produced)), NESTED_SCHEMA)
            valid += 1
        except (ValueError, jsonschema.ValidationError):
            pass
    out["random walks valid"] = f"{valid}/{walks}"
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--walks", type=int, default=20, help="random walks per library")
    parser.add_argument("--one", choices=LIBRARIES, help=argparse.SUPPRESS)
    options = parser.parse_args()
    if options.one:
        print(json.dumps(measure(options.one, options.walks)))
        return
    results: dict[str, dict[str, Any]] = {}
    for name in LIBRARIES:
        done = subprocess.run(
            [sys.executable, __file__, "--one", name, "--walks", str(options.walks)],
            capture_output=True,
            text=True,
            env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)},
        )
        if done.returncode:
            last = (done.stderr.strip().splitlines() or ["no output"])[-1]
            print(f"{name}: not measured ({last})")
            continue
        results[name] = json.loads(done.stdout.strip().splitlines()[-1])
    keys = list(next(iter(results.values())).keys()) if results else []
    print(f"{'':34}" + "".join(f"{name:>16}" for name in results) + "      ratio")
    for key in keys:
        values = [results[name][key] for name in results]
        cells = "".join(f"{v:>16.3f}" if isinstance(v, float) else f"{v!s:>16}" for v in values)
        ratio = ""
        if len(values) == 2 and all(isinstance(v, float) for v in values) and values[0]:
            ratio = f"{values[1] / values[0]:>10.2f}"
        print(f"{key:34}{cells}{ratio}")
    with open("/proc/loadavg") as f:
        print(f"load average: {f.read().strip()}")


if __name__ == "__main__":
    main()
