"""This machine's memory read bandwidth, and the one-stream bound it puts on each GGUF file.

A decoding step of one stream reads every weight once: the bytes of a file's tensors (the token
embedding only a row of it, unless the head multiplies it too: a tied head) divided by the read
bandwidth bound the tokens a second one stream can reach, whatever the kernels (issue 32: is
"1.3x llama-server at one stream" physically reachable here?).  The bandwidth is measured with
torch summing a buffer far larger than the caches (``--megabytes``, 1024 by default) on
``--threads`` threads (2: the cores a node and llama-server get), the fastest of ``--repeat``
passes.  Each file given is printed with its bytes read a token and its bound; ``--measured``
adds figures measured elsewhere (``bench/sizes.py``) beside them.

    .venv/bin/python bench/bandwidth.py ~/.cache/sfnode/sizes/*/*-Q*.gguf
    .venv/bin/python bench/bandwidth.py F.gguf --measured sfnode=48.1 --measured llama-server=50.3

This script only measures and prints; it asserts nothing, is not part of CI and is never imported
by the package.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def bandwidth(megabytes: int, threads: int, repeat: int) -> float:
    """Bytes a second torch reads summing a float32 buffer of ``megabytes`` (fastest pass)."""
    import torch

    torch.set_num_threads(threads)
    buffer = torch.ones(megabytes * (1 << 20) // 4, dtype=torch.float32)
    buffer.sum()  # every page touched once before timing
    best = float("inf")
    for _ in range(repeat):
        started = time.perf_counter()
        buffer.sum()
        best = min(best, time.perf_counter() - started)
    return buffer.numel() * 4 / best


def bytes_a_token(path: Path) -> int:
    """Bytes of ``path``'s tensors one decoding step reads: all of them but the token
    embedding, which only a row of is read unless there is no separate output matrix."""
    from sfnode.engines.weights.gguf import read_tensor_table

    entries = sorted(read_tensor_table(path), key=lambda e: e.offset)
    ends = [e.offset for e in entries[1:]] + [path.stat().st_size]
    sizes = {e.name: end - e.offset for e, end in zip(entries, ends, strict=True)}
    tied = "output.weight" not in sizes
    return sum(size for name, size in sizes.items() if tied or name != "token_embd.weight")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("files", nargs="*", type=Path, help="GGUF files")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--megabytes", type=int, default=1024)
    p.add_argument("--repeat", type=int, default=5)
    p.add_argument(
        "--measured",
        action="append",
        default=[],
        metavar="NAME=TOK_S",
        help="a figure measured elsewhere, printed beside each bound (repeatable)",
    )
    options = p.parse_args()
    rate = bandwidth(options.megabytes, options.threads, options.repeat)
    print(
        f"memory read bandwidth: {rate / 1e9:.1f} GB/s ({options.threads} threads, a "
        f"{options.megabytes} MB buffer summed by torch, fastest of {options.repeat})\n"
    )
    measured = [item.split("=", 1) for item in options.measured]
    head = "| file | MB read a token | one-stream bound |"
    rule = "|---|---|---|"
    for name, _ in measured:
        head += f" {name} | {name} / bound |"
        rule += "---|---|"
    print(head)
    print(rule)
    for path in options.files:
        read = bytes_a_token(path)
        bound = rate / read
        row = f"| {path.name} | {read / 1e6:.0f} | {bound:.1f} tok/s |"
        for _, value in measured:
            row += f" {float(value):.1f} | {float(value) / bound:.2f} |"
        print(row)


if __name__ == "__main__":
    main()
