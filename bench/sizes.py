"""sfnode next to llama.cpp's ``llama-server`` at a realistic size, for every family (issue 32).

For each family asked for (``--families``), a random-weight model of Qwen2.5-0.5B's shape (24
layers, hidden 896, 14 heads and 2 KV heads, intermediate 4864; the family's own features: Llama
3's rope, Qwen2's QKV biases, Qwen3's q/k norms, Mistral's sliding window) is written as a Hugging
Face folder, turned into a GGUF by llama.cpp's own ``convert_hf_to_gguf.py`` (``--outtype f16``)
and quantized by ``llama-quantize`` into each kind asked for (``--kinds``, Q4_K_M and Q8_0 by
default).  The vocabulary is the bundled SmolLM2's tokenizer (49,152 tokens, its chat template),
not Qwen2.5's 151,936: that tokenizer needs no download, and the converter knows its
pre-tokenizer.  The files are made once and kept in ``~/.cache/sfnode/sizes``.

Then, one server at a time, never two at once, as ``bench/peer.py`` runs them (its runners and
client, not a copy): ``twistd sfnode`` and ``twistd sfhead`` as two processes with default
settings, and ``llama-server -t 2 -np 8 -c 16384`` with the environment of the user's shell, on
the same file.  Printed as one Markdown table, per file and server: tok/s with 1 and 8
requests at a time (the fastest of ``--repeat`` tries, three by default), the median first
token one at a time, resident memory of the process holding the model (and of the head) as the
last answer ends and at rest two seconds later, and
the start time (from starting the processes to the first text of the warm-up answer; the node
is started once before, unmeasured, through one answer and its start-up check, so that the
conversion, the compiled kernels and every cache keyed to the engine's version are there), then
the ratios sfnode / llama-server beside the issue's targets.

    .venv/bin/python bench/sizes.py                                  # llama3, qwen2 (about 40 min)
    .venv/bin/python bench/sizes.py --families llama3 --kinds Q4_K_M --requests 8
    .venv/bin/python bench/sizes.py --make-only --families qwen3 mistral

This script only measures and prints; it asserts nothing, is not part of CI, is never imported by
the package, and never leaves a server running when it exits.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import peer
from _fleetproc import BenchError, child_env, cpu_extensions, cpu_name, run_guarded

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

SHAPE = {
    "num_hidden_layers": 24,
    "hidden_size": 896,
    "num_attention_heads": 14,
    "num_key_value_heads": 2,
    "intermediate_size": 4864,
    "max_position_embeddings": 32768,
    "initializer_range": 0.02,
    "rms_norm_eps": 1e-6,
}
"""Qwen2.5-0.5B's shape (its vocabulary aside)."""
FAMILIES = ("llama3", "qwen2", "qwen3", "mistral")
KINDS = ("Q4_K_M", "Q8_0")
LLAMA3_ROPE = {
    "rope_type": "llama3",
    "factor": 32.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
    "rope_theta": 500000.0,
}


def hf_config(family: str, vocab: int, bos: int, eos: int) -> Any:
    """The transformers configuration of ``family`` at :data:`SHAPE`."""
    import transformers as t

    common: dict[str, Any] = dict(SHAPE, vocab_size=vocab, bos_token_id=bos, eos_token_id=eos)
    if family == "llama3":
        return t.LlamaConfig(**common, rope_parameters=LLAMA3_ROPE, tie_word_embeddings=False)
    if family == "qwen2":
        return t.Qwen2Config(**common, tie_word_embeddings=True)
    if family == "qwen3":
        return t.Qwen3Config(**common, head_dim=64, tie_word_embeddings=True)
    if family == "mistral":
        return t.MistralConfig(**common, head_dim=64, sliding_window=4096)
    raise BenchError(f"no family {family!r} (known: {', '.join(FAMILIES)})")


def tokenizer_folder() -> Path:
    """The bundled SmolLM2's model files (its tokenizer and chat template), converted once."""
    from sfnode.engines.weights.loading import model_folder
    from sfnode.linkf.model_cache import default_gguf

    return model_folder(default_gguf())[1]


def write_folder(family: str, folder: Path) -> None:
    """``family``'s random model and the bundled tokenizer as a Hugging Face folder."""
    import torch
    from transformers import AutoModelForCausalLM

    source = tokenizer_folder()
    tokenizer = json.loads((source / "tokenizer.json").read_text())
    ids = [*tokenizer["model"]["vocab"].values(), *(t["id"] for t in tokenizer["added_tokens"])]
    vocab = max(ids) + 1
    config = json.loads((source / "config.json").read_text())
    eos = config["eos_token_id"]
    cfg = hf_config(family, vocab, config["bos_token_id"], eos[0] if isinstance(eos, list) else eos)
    torch.manual_seed(32)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)
    partial = folder.with_name(folder.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)
    model.save_pretrained(str(partial))
    del model
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        if (source / name).is_file():
            shutil.copy(source / name, partial / name)
    template = (source / "chat_template.jinja").read_text()
    settings = json.loads((partial / "tokenizer_config.json").read_text())
    settings["chat_template"] = template
    (partial / "tokenizer_config.json").write_text(json.dumps(settings, indent=1))
    os.replace(partial, folder)


def make(cache: Path, family: str, kinds: Sequence[str], quantize: Path) -> dict[str, Path]:
    """``family``'s GGUF of each kind, made once in ``cache`` (folder, F16, then quantized)."""
    base = cache / family
    folder = base / "hf"
    if not (folder / "config.json").is_file():
        print(f"writing a random {family} of Qwen2.5-0.5B's shape -> {folder}", flush=True)
        base.mkdir(parents=True, exist_ok=True)
        write_folder(family, folder)
    f16 = base / f"{family}-F16.gguf"
    if not f16.is_file():
        tree = llama_cpp(quantize)
        partial = f16.with_suffix(".partial")
        argv = [str(folder), "--outfile", str(partial), "--outtype", "f16"]
        run_tool(
            "convert_hf_to_gguf.py",
            [sys.executable, "-c", CONVERT.format(tree=str(tree)), *argv],
            base,
            {
                "PYTHONPATH": os.pathsep.join(
                    map(str, (tree, tree / "gguf-py", converter_lib(cache)))
                )
            },
        )
        os.replace(f16.with_suffix(".partial"), f16)
    made = {}
    for kind in kinds:
        target = base / f"{family}-{kind}.gguf"
        if not target.is_file():
            run_tool(
                "llama-quantize",
                [str(quantize), str(f16), str(target.with_suffix(".partial")), kind],
                base,
                {},
            )
            os.replace(target.with_suffix(".partial"), target)
        made[kind] = target
    return made


CONVERT = """
import runpy, sys
from conversion import base
known = base.TextModel.get_vocab_base_pre
def get_vocab_base_pre(self, tokenizer):
    try:
        return known(self, tokenizer)
    except NotImplementedError:
        return "smollm"
base.TextModel.get_vocab_base_pre = get_vocab_base_pre
sys.argv[0] = "{tree}/convert_hf_to_gguf.py"
runpy.run_path(sys.argv[0], run_name="__main__")
"""
"""llama.cpp's converter, with the bundled tokenizer's pre-tokenizer named when the converter's
hash of it differs: transformers 5 loads a Qwen folder's tokenizer as ``Qwen2Tokenizer``, with
Qwen's own pre-tokenizer, whatever the folder's ``tokenizer.json`` says (the tokenizer written
is the folder's, ``smollm`` is its name, as the Llama folder's hash finds)."""


def converter_lib(cache: Path) -> Path:
    """A folder with ``sentencepiece``, which llama.cpp's converter imports for every Llama
    (even one with a BPE tokenizer); installed there with pip when this Python lacks it."""
    lib = cache / "pylib"
    try:
        import sentencepiece  # noqa: F401
    except ImportError:
        if not (lib / "sentencepiece").is_dir():
            command = [
                sys.executable,
                "-m",
                "pip",
                "install",
                "--target",
                str(lib),
                "sentencepiece",
            ]
            run_tool("pip install sentencepiece", command, cache, {})
    return lib


def llama_cpp(quantize: Path) -> Path:
    """llama.cpp's source tree beside the built ``llama-quantize``."""
    return quantize.parent.parent.parent / "llama.cpp"


def run_tool(name: str, argv: list[str], folder: Path, extra: dict[str, str]) -> None:
    print(f"running {name} -> {folder}", flush=True)
    peer.run_tool(name, argv, folder / f"{name}.log", extra)


def prime(gguf: Path, options: argparse.Namespace, logs: Path) -> None:
    """Start the fleet once on ``gguf``, unmeasured, through one answer and the node's start-up
    check, so that the measured start is warm.  Always, not only before the first conversion:
    the compiled kernels and the caches keyed to the engine's version are redone after a change
    to the engine, and a measured run that redid them measured a start, not the node."""
    import asyncio

    from _fleetproc import (
        WARM_UP_TOPIC,
        Child,
        chat_body,
        fleet_processes,
        run_phase,
        served_model,
    )

    print(f"first start on {gguf.name} (conversion and caches; not measured)", flush=True)
    children: list[Child] = []
    env = child_env(options.node_env)
    with fleet_processes(options.node_arg, env, gguf, logs, children) as port:
        asyncio.run(run_phase(port, [chat_body(served_model(port), WARM_UP_TOPIC, 8)], 1))
        peer.wait_for_check(children[0])


def row(file: str, run: peer.ServerRun) -> str:
    one, eight = run.phases[1], run.phases[8]
    head = f" + {run.head_memory:.0f} head" if run.head_memory else ""
    return (
        f"| {file} | {run.label.split(' ')[0]} | {one.rate:.1f} | {eight.rate:.1f} "
        f"| {one.first_token_ms(0.5):.0f} ms | {run.serving_memory:.0f} / {run.memory[0]:.0f}"
        f"{head} MB (peak {run.memory[1]:.0f}) | {run.start:.1f} s |"
    )


def ratios(file: str, ours: peer.ServerRun, theirs: peer.ServerRun) -> str:
    r = peer.ratio
    serving = ours.serving_memory + ours.head_memory
    resting = ours.memory[0] + ours.head_memory
    return (
        f"| {file} | sfnode / llama-server | {r(ours.phases[1].rate, theirs.phases[1].rate):.2f}x "
        f"| {r(ours.phases[8].rate, theirs.phases[8].rate):.2f}x "
        f"| {r(ours.phases[1].first_token_ms(0.5), theirs.phases[1].first_token_ms(0.5)):.2f}x "
        f"| {r(serving, theirs.serving_memory):.2f}x / {r(resting, theirs.memory[0]):.2f}x "
        f"| {r(ours.start, theirs.start):.2f}x |"
    )


def run(options: argparse.Namespace) -> int:
    cache = (options.cache_dir or peer.default_cache()).expanduser().resolve()
    tools = peer.ensure_llama_cpp(cache, options.jobs)
    files = cache.parent / "sizes"
    made = {
        family: make(files, family, options.kinds, tools["llama-quantize"])
        for family in options.families
    }
    if options.make_only:
        for family, kinds in made.items():
            for kind, path in kinds.items():
                print(f"{family} {kind}: {path}")
        return 0
    logs = cache / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    started_load = os.getloadavg()[0]
    lines: list[str] = []
    for family, kinds in made.items():
        for kind, path in kinds.items():
            options.model = path
            prime(path, options, logs)
            ours = peer.run_fleet(options.node_arg, "as stored", options, logs)
            theirs = peer.run_llama_server(tools["llama-server"], path, kind, options, logs)
            file = f"{family} {kind}"
            lines += [row(file, ours), row(file, theirs), ratios(file, ours, theirs)]
    load = os.getloadavg()[0]
    print(
        f"\nQwen2.5-0.5B's shape, random weights, vocabulary 49,152; {options.requests} greedy "
        f"streamed chat requests per phase, max_tokens {options.max_tokens}, the fastest of "
        f"{options.repeat}; llama-server -t {options.threads} -np {options.parallel} -c "
        f"{options.ctx_size}; load average {started_load:.2f} at the start, {load:.2f} at the end"
    )
    print(f"CPU: {cpu_name()}; vector extensions: {cpu_extensions()}\n")
    print(
        "| file | server | tok/s, 1 at a time | tok/s, 8 at once | first token p50, 1 at a time "
        "| resident memory: serving / at rest | start to first token |"
    )
    print("|---|---|---|---|---|---|---|")
    print("\n".join(lines))
    print(
        "\nTargets (issue 32): Q4_K_M tok/s >= 1.3x at 1, >= 1.8x at 8; node + head memory "
        "<= 1.2x llama-server at the same context."
    )
    return 0


def parse(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="bench/sizes.py",
        description="\n\n".join((__doc__ or "").split("\n\n")[:3]),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--families", nargs="+", choices=FAMILIES, default=["llama3", "qwen2"])
    p.add_argument("--kinds", nargs="+", choices=KINDS, default=list(KINDS))
    p.add_argument("--make-only", action="store_true", help="make the files, then exit")
    p.add_argument("--requests", type=int, default=8, help="requests per phase (default: 8)")
    p.add_argument("--max-tokens", type=int, default=64, help="max_tokens (default: 64)")
    p.add_argument("--repeat", type=int, default=3, help="tries per phase, fastest kept")
    p.add_argument("--node-arg", action="append", default=[], metavar="ARG")
    p.add_argument("--node-env", action="append", default=[], metavar="KEY=VALUE")
    p.add_argument("--peer-arg", action="append", default=[], metavar="ARG")
    p.add_argument("--peer-env", action="append", default=[], metavar="KEY=VALUE")
    p.add_argument("--threads", type=int, default=2, help="llama-server -t (default: 2)")
    p.add_argument("--parallel", type=int, default=8, help="llama-server -np (default: 8)")
    p.add_argument("--ctx-size", type=int, default=16384, help="llama-server -c (default: 16384)")
    p.add_argument("--cache-dir", type=Path, default=None, help="as bench/peer.py's")
    p.add_argument("--jobs", type=int, default=os.cpu_count() or 1)
    options = p.parse_args(argv)
    options.workloads = ["story"]
    options.model = None
    return options


def main(argv: Sequence[str] | None = None) -> int:
    return run_guarded("bench/sizes.py", run, parse(argv))


if __name__ == "__main__":
    sys.exit(main())
