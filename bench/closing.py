"""What closing within the budget costs a lane's masks, on the bundled model's tokenizer
(SmolLM2, 49,152 tokens), as docs/engine.md section 2.4 reports.

For the targets' grammars (the nested JSON schema of tests/agents.py, ``json_object``, and the
three tools with ``tool_choice`` required), along a valid answer token by token:

- one lane's mask without a budget (the grammar's alone);
- with a budget far from the answer's end (the closing walked at every step, the mask left as
  the grammar's: the cost every constrained lane with a budget pays);
- with a budget one token past the answer's end (the lane closing for its last tokens: each
  allowed token checked for room);

per token the median and the mean in microseconds; then building the vocabulary's token table
(once per engine), and each grammar's shortest answer (``shortest_answer``, what a head compares
``max_tokens`` with).

    PYTHONPATH=. python bench/closing.py
    PYTHONPATH=. python bench/closing.py --repeat 5

This script only measures and prints; it must never assert or be imported by the package.
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any


def fills(vocabulary: Any, grammar: Any, tokens: list[int], limit: int | None) -> list[float]:
    """Seconds of each mask along ``tokens``, with ``limit`` tokens in all (None: no budget)."""
    from sfnode.decoding.constraint import Matcher

    matcher = Matcher(vocabulary, grammar)
    matcher.budget.limit = limit
    masks = vocabulary.new_masks(1)
    seconds = []
    for token in tokens:
        started = time.perf_counter()
        matcher.fill(masks, 0)
        seconds.append(time.perf_counter() - started)
        matcher.consume(token)
    return seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeat", type=int, default=3, help="answers walked per figure")
    options = parser.parse_args()

    from sfnode.decoding.constraint import (
        Vocabulary,
        response_format_grammar,
        shortest_answer,
        tools_grammar,
    )
    from sfnode.engines.weights import loading
    from tests.agents import NESTED_INSTANCE, NESTED_SCHEMA, TOOL_CALL_INSTANCE, TOOLS

    tokenizer = loading.load_tokenizer(None)
    started = time.perf_counter()
    vocabulary = Vocabulary.of_tokenizer(
        tokenizer, size=49152, eos_ids=[int(tokenizer.eos_token_id)]
    )
    built = time.perf_counter() - started
    grammars = {
        "nested schema": (
            response_format_grammar(
                {"type": "json_schema", "json_schema": {"name": "c", "schema": NESTED_SCHEMA}}
            ),
            NESTED_INSTANCE,
        ),
        "json_object": (response_format_grammar({"type": "json_object"}), NESTED_INSTANCE),
        "tools required": (tools_grammar(TOOLS, "required"), TOOL_CALL_INSTANCE),
    }
    print("| per token, us (median / mean) | no budget | budget far | closing at the end |")
    print("|---|---|---|---|")
    for label, (grammar, answer) in grammars.items():
        tokens = vocabulary.encode(answer)
        row = []
        for limit in (None, len(tokens) + 200, len(tokens) + 1):
            seconds = [
                s for _ in range(options.repeat) for s in fills(vocabulary, grammar, tokens, limit)
            ]
            row.append(
                f"{statistics.median(seconds) * 1e6:.0f} / {statistics.mean(seconds) * 1e6:.0f}"
            )
        print(f"| {label} ({len(tokens)} tokens) | " + " | ".join(row) + " |")
    print(f"\nvocabulary with its token table: {built:.2f} s")
    for label, (grammar, _) in grammars.items():
        print(f"shortest answer, {label}: {shortest_answer(vocabulary, grammar)} tokens")


if __name__ == "__main__":
    main()
