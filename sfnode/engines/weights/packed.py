"""What a start keeps for the next one beside a GGUF model's files (docs/engine.md sections 5
and 5.3): the kernels' self-check results per CPU kind (:data:`CHECKS_FILE`), the weights
packed for the kernels (``packed-weights*.safetensors``) and what the start-up check of
exactness computed (:data:`EXACTNESS_FILE`), keyed so that another engine
(:func:`engine_version`), another torch, another CPU kind, another mode or another layout never
reads them; the folder itself is named by the GGUF file's content, so another file never does.

Only what was converted is kept (Q4_1 blocks laid out in tiles, matrices quantized again for a
kernel); a matrix multiplied as the file stores it is read from the file at every start, never
copied here.  Every write is atomic (a temporary file, then a rename), and a file that cannot be
read is ignored with one log line: the caller packs again.

This module must never decide which kernel a matrix gets; it only keeps and reads back what the
gatherer (:mod:`sfnode.engines.weights.gather`) built.
"""

from __future__ import annotations

import functools
import hashlib
import json
from pathlib import Path
from typing import Any

import torch
from twisted.logger import Logger

from sfnode.engines.kernels import native
from sfnode.engines.kernels.choice import Choice, Cpu
from sfnode.engines.kernels.quant import (
    JoinedLinear,
    Linear,
    Precision,
    kernel_works,
    linear_from_state,
)
from sfnode.linkf.atomic_files import replacing, write_json

log = Logger(namespace="sfnode.engines.weights")

CHECKS_FILE = "kernel-checks.json"
"""The kernels' self-check results kept beside the packed weights, per CPU kind and torch."""
EXACTNESS_FILE = "exactness-check.json"
"""The digest of what the start-up check of exactness computed, per engine, CPU kind and way
of serving (docs/engine.md section 4.1)."""
_CACHE_FORMAT = 3


@functools.cache
def engine_version() -> str:
    """Names the engine that packs, multiplies and checks the weights: a hash of torch's version
    and of sfnode's engine sources (``native.c`` and every module of ``sfnode/engines``), so
    that kept results of another engine are never read."""
    root = Path(__file__).resolve().parent.parent
    digest = hashlib.sha256(torch.__version__.encode())
    for path in sorted([*root.rglob("*.py"), *root.rglob("*.c")]):
        digest.update(path.relative_to(root).as_posix().encode())
        digest.update(path.read_bytes())
    return digest.hexdigest()[:16]


def usable_precisions() -> dict[Precision, str | None]:
    """Each precision's self-check result (None: usable)."""
    return {p: kernel_works(p) for p in Precision}


def cached_precisions(folder: Path | None) -> dict[Precision, str | None]:
    """:func:`usable_precisions`, read from ``folder``'s :data:`CHECKS_FILE` when it holds this
    CPU kind's results (its flags and torch's version: what the results depend on), else run
    and kept there (best effort)."""
    if folder is None:
        return usable_precisions()
    key = f"{Cpu.here().key()}-{engine_version()}"
    path = folder / CHECKS_FILE
    kept = _read_json(path)
    results = kept.get(key)
    if isinstance(results, dict):
        # A precision missing from the kept results reads as False: not a result, so all run.
        checks = {p: results.get(p.value, False) for p in Precision}
        if all(reason is None or isinstance(reason, str) for reason in checks.values()):
            return checks
    checks = usable_precisions()
    kept[key] = {p.value: reason for p, reason in checks.items()}
    try:
        write_json(path, kept, indent=1, sort_keys=True)
    except OSError as e:
        log.warn("cannot keep the kernels' self-checks in {path}: {e}", path=str(path), e=e)
    return checks


def _read_json(path: Path) -> dict[str, Any]:
    """The object kept in ``path``; empty when there is none or it cannot be read."""
    try:
        kept = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return kept if isinstance(kept, dict) else {}


def kept_digest(folder: Path, key: str) -> str | None:
    """The digest the start-up check of exactness kept in ``folder`` for ``key`` (None:
    none)."""
    digest = _read_json(folder / EXACTNESS_FILE).get(key)
    return digest if isinstance(digest, str) else None


def keep_digest(folder: Path, key: str, digest: str) -> None:
    """Keep ``digest`` for ``key`` in ``folder`` (best effort: one log line when it cannot)."""
    path = folder / EXACTNESS_FILE
    kept = _read_json(path)
    kept[key] = digest
    try:
        write_json(path, kept, indent=1, sort_keys=True)
    except OSError as e:
        log.warn("cannot keep the check of exactness in {path}: {e}", path=str(path), e=e)


def keepable(linear: Linear) -> bool:
    """Whether ``linear`` was converted for its kernel (and is worth keeping): not a matrix
    multiplied as stored, nor a projection of parts."""
    return not getattr(linear, "as_stored", False) and not isinstance(linear, JoinedLinear)


def signature(
    mode: str, checks: dict[Precision, str | None], family: Choice, cache_file: Path | None
) -> tuple[dict[str, str], Path | None]:
    """What packed weights kept in a file must have been packed for, and that file."""
    found = {
        "format": str(_CACHE_FORMAT),
        "engine": engine_version(),
        "torch": torch.__version__,
        "mode": mode,
        "usable": ",".join(sorted(p.value for p, reason in checks.items() if reason is None)),
    }
    if family.family == "native":
        # Another file for another layout, so that older code keeps reading its own.
        found["family"] = "native-tiles2"
        found["usable"] = "native"
        if cache_file is not None:
            cache_file = cache_file.with_name(f"{cache_file.stem}-tiles2{cache_file.suffix}")
    return found, cache_file


def load(
    path: Path | None,
    wanted: dict[str, Precision],
    expected: dict[str, str],
    library: native.Library | None = None,
) -> dict[str, Linear] | None:
    """The kept kernels by projection name, from a file written for ``expected`` (its
    signature) and the same ``wanted`` precisions; None when there is none such."""
    if path is None or not path.is_file():
        return None
    from safetensors import safe_open

    try:
        with safe_open(str(path), framework="pt") as f:
            meta = f.metadata() or {}
            if any(meta.get(key) != value for key, value in expected.items()):
                return None
            if {k: Precision(v) for k, v in json.loads(meta["wanted"]).items()} != wanted:
                return None
            chosen = {k: Precision(v) for k, v in json.loads(meta["chosen"]).items()}
            # The reader gives each tensor in memory of its own; only one that does not start
            # on a 64-byte boundary is copied again: the quantized kernels' vector loads expect
            # that alignment (the int8 kernel crashed on an 8-byte aligned one), and a fresh
            # tensor has it.
            tensors = {}
            for key in f.keys():
                tensor = f.get_tensor(key)
                tensors[key] = tensor if tensor.data_ptr() % 64 == 0 else tensor.clone()
    except (OSError, ValueError, KeyError, RuntimeError) as e:
        log.warn("ignoring unreadable packed weights {path}: {e}", path=str(path), e=e)
        return None
    linears = {
        name: _rebuilt(precision, _state_of(tensors, name), library)
        for name, precision in chosen.items()
    }
    log.info("read packed weights from {path}", path=str(path))
    return linears


def _state_of(tensors: dict[str, torch.Tensor], name: str) -> dict[str, torch.Tensor]:
    prefix = f"{name}/"
    return {k[len(prefix) :]: v for k, v in tensors.items() if k.startswith(prefix)}


def _rebuilt(
    precision: Precision, state: dict[str, torch.Tensor], library: native.Library | None
) -> Linear:
    """The kernel a kept state was saved from (the native family's with ``library``)."""
    if library is not None and precision is Precision.INT4:
        return native.Q4Linear(
            None,
            int(state["in_features"].item()),
            library,
            tiles=state["tiles"],
            out_features=int(state["out_features"].item()),
        )
    if library is not None and precision is Precision.INT8:
        return native.Q8Linear(state["weight"], state["scales"], library)
    if library is not None and precision is Precision.FLOAT32:
        return native.F32Linear(state["weight"], library)
    return linear_from_state(precision, state)


def save(
    path: Path, expected: dict[str, str], wanted: dict[str, Precision], linears: dict[str, Linear]
) -> None:
    """Keep the converted ones of ``linears`` (:func:`keepable`) in ``path``, atomically."""
    from safetensors.torch import save_file

    kept = {name: linear for name, linear in linears.items() if keepable(linear)}
    tensors = {
        f"{name}/{key}": value.contiguous()
        for name, layer in kept.items()
        for key, value in layer.state().items()
    }
    meta = dict(expected)
    meta["wanted"] = json.dumps({k: v.value for k, v in wanted.items()})
    meta["chosen"] = json.dumps({k: v.precision.value for k, v in kept.items()})
    path.parent.mkdir(parents=True, exist_ok=True)
    with replacing(path) as tmp:
        save_file(tensors, str(tmp), metadata=meta)
    log.info("kept the packed weights in {path}", path=str(path))


__all__ = [
    "CHECKS_FILE",
    "EXACTNESS_FILE",
    "cached_precisions",
    "engine_version",
    "keep_digest",
    "keepable",
    "kept_digest",
    "load",
    "save",
    "signature",
]
