"""The families served, as one table (docs/engine.md section 5.4): for every family's tiny
model (tests/families.py) and kind of file (its folder; GGUF F32, Q8_0 and Q4_K_M as llama.cpp's
converter writes them), the engine ``twistd sfnode --model`` builds, through the node's own
builder, by default options and with ``--eager-step`` (the layers as torch operators):

- served (``yes``) or refused (the first words of the reason);
- the path: ``native`` (the whole step in sfnode's native calls) or ``torch ops``;
- tokens equal: how many of the first 48 greedy tokens equal the reference before the first
  that differs (transformers' ``generate()`` on the folder in float32; for a quantized file,
  on the folder's model with the file's matrices dequantized into it, its activations held as
  the kernels hold them: tests/test_family_engines.py ``reference``), and where they part how
  near a tie the reference had there (its best logit minus the engine's token's, relative);
- vs float32: the same count against the float32 run (what quantizing costs), and the
  positions of the float32 run's 48 where the file's matrices, given the float32 tokens before,
  choose the same next token (one early difference makes every later greedy token differ, so
  this is the fairer measure of agreement);
- held/file: the weights the step reads per byte of the weight files (the engine's own
  figure, what its log line and ``/metrics`` show).

A last row shows an architecture no family reads (the Qwen2 F32 file renamed ``mamba``).

    PYTHONPATH=. python bench/families.py
    PYTHONPATH=. python bench/families.py --families llama qwen3 --kinds Q4_K_M

This script only measures and prints; it must never assert or be imported by the package.
"""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

from twisted.internet import defer, task

LABELS = {"llama2": "llama", "llama": "llama3-rope"}
"""The families' names in the table (the tiny ``llama`` has Llama 3's rope)."""


def forced(family: str, kind: str, float32: list[int]) -> int:
    """Positions where the reference of ``kind``, given the float32 run's tokens before,
    chooses the float32 run's next token."""
    import torch

    from tests import test_family_engines as t

    ids = torch.tensor([t.PROMPT + float32[:-1]])
    with torch.no_grad():
        chosen = t.reference(family, kind)(ids).logits[0, len(t.PROMPT) - 1 :].argmax(-1)
    return sum(int(a == b) for a, b in zip(chosen.tolist(), float32, strict=True))


def equal(family: str, kind: str, got: list[int], want: list[int]) -> str:
    """``n/48``, and where the tokens part, how near a tie the reference had there."""
    from tests import test_family_engines as t

    n = leading(got, want)
    if n == len(want) == len(got):
        return f"{n}/{t.TOKENS}"
    return f"{n}/{t.TOKENS} (tie {t.tie(family, kind, got, n):.0e})"


def leading(got: list[int], want: list[int]) -> int:
    """Tokens equal before the first that differs."""
    for i, (a, b) in enumerate(zip(got, want, strict=False)):
        if a != b:
            return i
    return min(len(got), len(want))


@defer.inlineCallbacks
def one_row(family: str, kind: str, extra: tuple[str, ...]) -> Any:
    """The table's row of ``family``'s ``kind`` built with ``extra`` options."""
    from sfnode.node import tap
    from tests import test_family_engines as t

    label = LABELS.get(family, family)
    path = "torch ops" if "--eager-step" in extra else "default"
    try:
        engine = t.build(t.source(family, kind), *extra)
    except tap.NodeStartupError as e:
        return [label, kind, f"refused: {str(e)[:60]}", path, "-", "-", "-"]
    started = time.monotonic()
    tokens = yield t.FamilyEngineTests().greedy(engine)
    seconds = time.monotonic() - started
    want = t.expected(family, kind)
    float32 = t.expected(family, "F32" if kind != "folder" else kind)
    figures = engine.statistics().weights
    ratio = f"{figures.ratio:.2f}" if figures is not None else "-"
    return [
        label,
        kind,
        "yes",
        "native" if engine.fused_step else "torch ops",
        equal(family, kind, tokens, want),
        f"{leading(tokens, float32)}/{t.TOKENS} ({forced(family, kind, float32)} forced)",
        ratio,
        f"{seconds:.2f}",
    ]


def print_table(rows: list[list[str]]) -> None:
    header = ["family", "kind", "served", "path", "tokens equal", "vs float32", "held/file", "s"]
    print("| " + " | ".join(header) + " |")
    print("|" + "|".join("---" for _ in header) + "|")
    for row in rows:
        print("| " + " | ".join(row + [""] * (len(header) - len(row))) + " |")


@defer.inlineCallbacks
def main(reactor: Any, options: argparse.Namespace) -> Any:
    from sfnode.node import tap
    from tests import test_family_engines as t

    rows: list[list[str]] = []
    settings = [("--kernels", "auto")] + ([("--eager-step",)] if options.torch_ops else [])
    for family in options.families:
        for kind in options.kinds:
            for extra in settings:
                rows.append((yield one_row(family, kind, extra)))
    unsupported = t.mamba_file_at(Path(options.workspace or t.families._workspace()))
    try:
        t.build(unsupported)
        rows.append(["mamba", "F32", "yes (should be refused)"])
    except tap.NodeStartupError as e:
        rows.append(["mamba", "F32", f"refused: {e}", "-", "-", "-", "-"])
    print_table(rows)


def parse() -> argparse.Namespace:
    from tests import families, test_family_engines

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--families", nargs="+", default=list(families.FAMILY_NAMES))
    parser.add_argument("--kinds", nargs="+", default=list(test_family_engines.KINDS))
    parser.add_argument(
        "--no-torch-ops",
        dest="torch_ops",
        action="store_false",
        help="only the default options (no --eager-step rows)",
    )
    parser.add_argument("--workspace", help="where the files are written (default: a temp dir)")
    return parser.parse_args()


if __name__ == "__main__":
    task.react(main, [parse()])
