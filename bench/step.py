"""Where a decode step's time goes: the Llama runner's step at batch 1 and 8, whole and with its
parts taken out one by one.

The runner is built as ``twistd sfnode`` builds it (the bundled model's own weights by default)
and timed on one thread with ``time.thread_time``, which counts only the time this thread ran,
so other processes on the machine change the figures less than they change wall time.  Printed
per batch size: the whole step, then the step with the layers' matrix products replaced by
ready-made zeros, then also without the output head and sampling, without attention, without
the norms, and without the rotary embedding.  The differences are what each part costs; what is
left at the end is the rest (KV writes, residual adds, the MLP's gate, Python).  When the runner
runs the whole step in sfnode's native code (docs/engine.md section 5.2), the products, norms,
rotary embedding, attention, gate and residual adds are one part (the native layers call), and
the output head another.  A prompt chunk's step (``--chunk`` tokens) is timed first.
``--kernels`` and ``--eager-step`` choose the kernels as ``twistd sfnode`` does.  With
``--threads`` above 1 the step runs on that many threads (as a node runs it) and is timed in
wall time (``time.perf_counter``), which a loaded machine lengthens.

    PYTHONPATH=. python bench/step.py                  # the bundled SmolLM2, --weights auto
    PYTHONPATH=. python bench/step.py --weights float32 --length 500
    PYTHONPATH=. python bench/step.py --kernels torch --eager-step   # torch's kernels, unfused
    PYTHONPATH=. python bench/step.py --batches 8 --threads 2        # wall time, two threads

This script only measures and prints; it must never assert or be imported by the package.
"""

from __future__ import annotations

import argparse
import os
import time
from collections.abc import Callable
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")


CLOCK = time.thread_time
"""The clock the steps are timed with: this thread's CPU time, or wall time (``--threads``)."""


def median_ms(f: Callable[[], Any], n: int = 31) -> float:
    times = []
    for _ in range(n):
        started = CLOCK()
        f()
        times.append(CLOCK() - started)
    times.sort()
    return times[n // 2] * 1000


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None, help="model folder or .gguf (default: bundled)")
    parser.add_argument("--weights", default="auto")
    parser.add_argument("--length", type=int, default=100, help="context length of each lane")
    parser.add_argument("--batches", default="1,8", help="batch sizes, comma-separated")
    parser.add_argument("--kernels", default="auto", help="auto, torch or native")
    parser.add_argument("--eager-step", action="store_true", help="no native step")
    parser.add_argument("--threads", type=int, default=1, help="threads (above 1: wall time)")
    parser.add_argument(
        "--chunk", type=int, default=16, help="prompt tokens of the prompt-chunk step (0: none)"
    )
    options = parser.parse_args()

    import torch
    import torch.nn.functional as F  # noqa: N812

    import sfnode.engines.runners.attention as attention_module
    import sfnode.engines.runners.decoder as runner_module
    from sfnode.engines.kernels import quant
    from sfnode.engines.runners.decoder import DecoderRunner
    from sfnode.engines.scheduling.plan import ChunkRow, DecodeRow, StepPlan
    from sfnode.engines.weights.gather import gather_weights
    from sfnode.engines.weights.loading import load_model
    from sfnode.linkf.wire import GenParams

    torch.set_num_threads(options.threads)
    global CLOCK
    CLOCK = time.thread_time if options.threads == 1 else time.perf_counter
    loaded = load_model(options.model)
    weights = gather_weights(
        loaded.stored,
        options.weights,
        cache_file=loaded.cache_file,
        kernels=options.kernels,
        fused_step=not options.eager_step,
    )
    batches = [int(b) for b in options.batches.split(",")]
    runner = DecoderRunner(weights, slots=max(batches), window=4096, fused=not options.eager_step)
    greedy = GenParams()
    length = options.length
    for slot in range(max(batches)):
        prompt = tuple(range(1, length + 1))
        runner.run(StepPlan(chunks=(ChunkRow(slot, 0, prompt, True, greedy, 0),)))
    plans = {
        b: StepPlan(decode=tuple(DecodeRow(s, 5, length, greedy, 0) for s in range(b)))
        for b in batches
    }
    family = weights.family.family if weights.family is not None else "torch"
    fused = "native step" if runner.fused is not None else "layers as torch operators"
    print(
        f"{loaded.name}, weights {weights.mode} ({weights.describe()}, {family} kernels, "
        f"{fused}), {length} positions a lane, "
        + (
            "one thread, CPU ms per step (median of 31)"
            if options.threads == 1
            else f"{options.threads} threads, wall ms per step (median of 31)"
        )
    )
    rows: list[tuple[str, dict[int, float]]] = []

    def measure(label: str) -> None:
        rows.append((label, {b: median_ms(lambda p=p: runner.run(p)) for b, p in plans.items()}))

    if options.chunk:
        # A prompt chunk into a spare slot (what a first token waits for), whole.
        chunk_runner = DecoderRunner(weights, slots=1, window=4096, fused=not options.eager_step)
        chunk = StepPlan(
            chunks=(ChunkRow(0, 0, tuple(range(1, options.chunk + 1)), True, greedy, 0),)
        )
        print(
            f"a prompt chunk of {options.chunk} tokens (first token): "
            f"{median_ms(lambda: chunk_runner.run(chunk), 11):.2f} CPU ms (median of 11)"
        )
    measure("whole step")
    zeros: dict[tuple[int, int], torch.Tensor] = {}
    if runner.fused is not None:
        # The native step: the layers (one call) and the head (one call); the rest is the
        # sampler and Python.
        native_step = runner.fused
        vocab = weights.vocab_size
        hidden_zeros: dict[int, torch.Tensor] = {}

        def no_forward(kv: Any, positions: Any, slots: Any, **kw: Any) -> torch.Tensor:
            n = len(positions)
            if n not in hidden_zeros:
                hidden_zeros[n] = torch.zeros((n, weights.hidden))
            return hidden_zeros[n]

        native_step.forward = no_forward  # type: ignore[method-assign]
        measure("- native layers (products, norms, rotary, attention, KV writes, gate)")
        native_step.logits = (  # type: ignore[method-assign]
            lambda hidden, masks=None, refined=0: torch.zeros(hidden.shape[0], vocab)
        )
        measure("- native head (norm, product, refined logits; what is left: sampling, Python)")
        report(batches, rows)
        return

    def no_product(self: Any, x: torch.Tensor, *, dense: bool = False) -> torch.Tensor:
        key = (x.shape[0], self.out_features)
        if key not in zeros:
            zeros[key] = torch.zeros(key, dtype=x.dtype)
        return zeros[key]

    quant.Projection.__call__ = no_product  # type: ignore[method-assign]
    measure("- layer matrix products")
    vocab = weights.vocab_size
    runner._logits = lambda hidden, wanted, allowed=None: torch.zeros(len(wanted), vocab)  # type: ignore[method-assign]
    measure("- output head, sampling")
    attention_module.F.scaled_dot_product_attention = (  # type: ignore[attr-defined]
        lambda q, k, v, **kw: torch.zeros(q.shape, dtype=q.dtype)
    )
    measure("- attention")
    runner_module.F.rms_norm = lambda x, shape, weight, eps: x  # type: ignore[attr-defined]
    measure("- norms")
    runner_module.rotate = lambda x, cos, sin: x  # type: ignore[assignment]
    measure("- rotary embedding (what is left: the rest)")
    del F

    report(batches, rows)


def report(batches: list[int], rows: list[tuple[str, dict[int, float]]]) -> None:
    print("| step | " + " | ".join(f"batch {b}" for b in batches) + " |")
    print("|---|" + "---|" * len(batches))
    previous: dict[int, float] | None = None
    for label, figures in rows:
        cells = []
        for b in batches:
            cell = f"{figures[b]:.2f}"
            if previous is not None:
                cell += f" (part: {previous[b] - figures[b]:.2f})"
            cells.append(cell)
        print(f"| {label} | " + " | ".join(cells) + " |")
        previous = figures


if __name__ == "__main__":
    main()
