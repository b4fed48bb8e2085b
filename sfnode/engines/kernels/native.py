"""sfnode's own AVX2 kernels and decode step for float32 activations, built at start with the
machine's C compiler and kept in a cache folder, or shipped built in the wheel (docs/engine.md
sections 5.1 and 5.2).

Why: on a CPU without AVX512-BF16 (most cloud VMs, many desktops; AVX2-only AMD EPYC machines
among them) bfloat16 arithmetic is emulated, so torch's quantized kernels, which want bfloat16
activations, spend their time converting; and a decode step of eager torch operators spends as
much time dispatching its few hundred small operators as multiplying.  The C source
(``native.c`` beside this module) has products for 4-bit weights (GGUF Q4_1 blocks, laid out in
tiles of 8 output rows), int8 and float32 weights, each activation row quantized by itself to
int16 per block of 32 for the integer kernels; and the whole decode step of a Llama-family model
(every layer, attention over the KV slots included, then the output head and its best logits
computed again in float32) in two calls.  Every row is computed by itself in the same order of
operations whatever else is in the call, so the results are batch-invariant, and a position's
keys and values do not depend on how its prompt was cut into steps.  The work is split between
the OpenMP threads of the runtime torch itself uses (the library links the ``libgomp.so.1``
torch has already loaded, so no second thread team appears; docs/engine.md section 6).

The library is compiled once per (source, compiler, flags) into ``cache_dir`` (atomically, so two
processes may race; :mod:`sfnode.engines.kernels.native_build` holds the flags and the compile)
and loaded with ctypes; where no C compiler is found (or it fails), the build the wheel ships is
loaded instead.  :func:`load` answers the library or the reason it cannot: a CPU without
AVX2/FMA/F16C, or neither a compiler nor a shipped build (then it also logs a WARNING); the caller
then keeps torch's kernels and logs that one reason.

This module must never run a kernel on a CPU whose flags it has not checked, never write a
half-built library where a later start would load it, and never touch a model or a thread.
"""

from __future__ import annotations

import ctypes
import dataclasses
import hashlib
import subprocess
import time
import weakref
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import numpy as np
import torch
from twisted.logger import Logger

from sfnode.engines.kernels.maps import give_back
from sfnode.engines.kernels.native_build import (
    COMPILE_FLAGS,
    NEEDED_FLAGS,
    SHIPPED_FOLDER,
    compile_library,
    compiler,
    shipped_name,
    source,
)
from sfnode.engines.kernels.quant import JoinedLinear, Precision

log = Logger(namespace="sfnode.engines.kernels.native")

BLOCK = 32
BLOCK_BYTES = 20
"""A Q4_1 block: float16 d, float16 m, 16 bytes holding 32 nibbles."""

SOURCE = source()
"""The library's C source (``native.c`` beside this module)."""

NO_COMPILER = "no C compiler found (set CC, or install gcc)"


def cpu_flags(cpuinfo: Path = Path("/proc/cpuinfo")) -> frozenset[str]:
    """The first CPU's flags as the kernel lists them (empty where there is no /proc/cpuinfo)."""
    try:
        text = cpuinfo.read_text()
    except OSError:
        return frozenset()
    for line in text.splitlines():
        key, _, value = line.partition(":")
        if key.strip() in ("flags", "Features"):
            return frozenset(value.split())
    return frozenset()


def _torch_openmp() -> Path | None:
    """The OpenMP runtime file torch ships (its ``lib`` folder), if any."""
    found = sorted((Path(torch.__file__).parent / "lib").glob("libgomp*.so*"))
    return found[0] if found else None


def shipped_library() -> Path | None:
    """The build of this source that the installed wheel carries, if it carries one (a source
    checkout carries none: it compiles at first use)."""
    path = Path(__file__).parent / SHIPPED_FOLDER / shipped_name(SOURCE)
    return path if path.is_file() else None


@dataclass(frozen=True)
class Library:
    """A loaded kernel library and where it came from."""

    path: Path
    built_seconds: float
    """Seconds spent compiling it at this start (0.0: it was in the cache, or shipped)."""
    handle: Any
    shipped: bool = False
    """Whether it is the build the wheel shipped (no usable C compiler here)."""


_loaded: dict[Path, Library] = {}
_warned: set[str] = set()


def library_name(cc: str) -> str:
    """The cache file name for this source built by ``cc`` (its version included)."""
    try:
        version = subprocess.run(
            [cc, "--version"], capture_output=True, text=True, timeout=30
        ).stdout.splitlines()[:1]
    except (OSError, subprocess.SubprocessError):
        version = []
    key = "\n".join([SOURCE, " ".join(COMPILE_FLAGS), *version, torch.__version__])
    return f"sfnode-q4-{hashlib.sha256(key.encode()).hexdigest()[:16]}.so"


def load(cache_dir: Path, flags: frozenset[str] | None = None) -> Library | str:
    """The kernel library, or why not: compiled into ``cache_dir`` first if it is not there;
    without a C compiler (or where it fails), the build the wheel shipped.  Where neither can be
    had on a CPU that could run them, a WARNING says so and what the node does instead."""
    flags = cpu_flags() if flags is None else flags
    missing = sorted(NEEDED_FLAGS - flags)
    if missing:
        return f"the CPU lacks {', '.join(missing)}"
    cc = compiler()
    reason = NO_COMPILER if cc is None else ""
    if cc is not None:
        built = _load_built(cc, cache_dir)
        if isinstance(built, Library):
            return built
        reason = built
    shipped = shipped_library()
    if shipped is None:
        reason += "; this install ships no prebuilt native library"
    else:
        opened = _open(shipped, 0.0, shipped=True)
        if isinstance(opened, Library):
            return opened
        reason += f"; {opened}"
    _warn_unavailable(reason)
    return reason


def _load_built(cc: str, cache_dir: Path) -> Library | str:
    """The library ``cc`` builds, from ``cache_dir`` (compiled there first if it is not)."""
    path = cache_dir / library_name(cc)
    if path in _loaded:
        # Loaded already in this process: nothing was built for this call.
        return dataclasses.replace(_loaded[path], built_seconds=0.0)
    built = 0.0
    if not path.is_file():
        started = time.monotonic()
        openmp = _torch_openmp()
        # Link the runtime torch already has loaded (same soname): one OpenMP team.
        link = [f"-L{openmp.parent}", f"-Wl,-rpath,{openmp.parent}"] if openmp else []
        reason = compile_library(cc, SOURCE, path, link)
        if reason is not None:
            return reason
        built = time.monotonic() - started
    return _open(path, built)


def _open(path: Path, built: float, *, shipped: bool = False) -> Library | str:
    """The library at ``path`` loaded and its functions typed, or why it cannot be."""
    if path in _loaded:
        return _loaded[path]
    openmp = _torch_openmp()
    pointer, integer = ctypes.c_void_p, ctypes.c_int
    signatures = {
        "sf_linear": [pointer, pointer, integer, pointer, integer],
        "sf_linear_form": [pointer, pointer, integer, pointer, integer, integer],
        "sf_vnni": [],
        "sf_forward": [pointer, pointer, integer, pointer, pointer, pointer, pointer]
        + [integer] * 3,
        "sf_logits": [pointer, integer, pointer, pointer, integer, integer, pointer, integer],
        "sf_tile_q4": [pointer, integer, integer, pointer],
        "sf_untile_q4": [pointer, integer, integer, pointer],
        "sf_tile_q5": [pointer, integer, integer, pointer],
        "sf_untile_q5": [pointer, integer, integer, pointer],
        "sf_tile_q8": [pointer, integer, integer, pointer],
        "sf_untile_q8": [pointer, integer, integer, pointer],
        "sf_tile_q4k": [pointer, integer, integer, pointer],
        "sf_untile_q4k": [pointer, integer, integer, pointer],
        "sf_tile_q6k": [pointer, integer, integer, pointer],
        "sf_untile_q6k": [pointer, integer, integer, pointer],
        "sf_dequantize": [integer, pointer, ctypes.c_int64, pointer],
    }
    try:
        if shipped and openmp is not None:
            # A shipped build names libgomp.so.1 with no path: torch's (already loaded by torch
            # itself) answers that name, as it does for a build linked here.
            ctypes.CDLL(str(openmp), mode=ctypes.RTLD_GLOBAL)
        handle = ctypes.CDLL(str(path))
        for name, argtypes in signatures.items():
            function = getattr(handle, name)
            function.argtypes = argtypes
            function.restype = ctypes.c_int
    except (OSError, AttributeError) as e:
        return f"cannot load {path}: {e}"
    library = Library(path, built, handle, shipped)
    _loaded[path] = library
    return library


def _warn_unavailable(reason: str) -> None:
    """One WARNING per reason and process: the node falls back to torch's kernels."""
    if reason in _warned:
        return
    _warned.add(reason)
    log.warn(
        "sfnode's native kernels cannot be had on this machine: {reason}; the node falls back "
        "to torch's kernels (bfloat16 activations for int4 and int8 weights, slower where the "
        "CPU emulates bfloat16) and runs its layers as torch operators (docs/engine.md "
        "section 5.1)",
        reason=reason,
    )


# -- weights ----------------------------------------------------------------------------------


def pack_blocks(q: torch.Tensor, scale: torch.Tensor, minimum: torch.Tensor) -> torch.Tensor:
    """Q4_1 blocks ``[rows, cols / 32 * 20]`` (uint8) of ``w = scale * q + minimum`` per group.

    ``q`` is ``[rows, cols]`` in 0..15; ``scale`` and ``minimum`` ``[rows, groups]`` (held as
    float16, as in a GGUF file).
    """
    rows, cols = q.shape
    groups = cols // BLOCK
    nibbles = q.to(torch.uint8).reshape(rows, groups, BLOCK).numpy()
    packed = nibbles[..., :16] | (nibbles[..., 16:] << 4)
    d = scale.to(torch.float32).numpy().astype(np.float16).view(np.uint8)
    m = minimum.to(torch.float32).numpy().astype(np.float16).view(np.uint8)
    blocks = np.concatenate(
        [d.reshape(rows, groups, 2), m.reshape(rows, groups, 2), packed.astype(np.uint8)], axis=-1
    )
    return torch.from_numpy(np.ascontiguousarray(blocks.reshape(rows, groups * BLOCK_BYTES)))


def gguf_blocks(matrices: list[Any]) -> torch.Tensor:
    """Q4_1 blocks of GGUF 4-bit matrices stacked along their rows (a fused projection): a Q4_1
    file's own bytes, a Q4_0 matrix rewritten with its minimum ``-8 d``."""
    from sfnode.engines.kernels.quant import q4_parts

    parts = []
    for matrix in matrices:
        if matrix.kind == "Q4_1":
            parts.append(torch.from_numpy(np.array(matrix.data, dtype=np.uint8, copy=True)))
        else:
            parts.append(pack_blocks(*q4_parts(matrix)))
    return torch.cat(parts) if len(parts) > 1 else parts[0]


def dequantize_k(library: Library, kind: str, data: np.ndarray[Any, Any]) -> torch.Tensor:
    """The float32 weights of K-quant super-blocks (``kind`` Q4_K, Q5_K or Q6_K; ``data`` whole
    blocks, any shape of uint8), dequantized a block at a time by the library's
    ``sf_dequantize``: bit for bit :func:`sfnode.engines.kernels.blocks.dequantize`."""
    from sfnode.engines.kernels.blocks import FORMATS, K_QUANTS

    if kind not in K_QUANTS:
        raise ValueError(f"not a K-quant: {kind}")
    form = FORMATS[kind]
    raw = np.ascontiguousarray(data, dtype=np.uint8).reshape(-1)
    if raw.size % form.size:
        raise ValueError(f"{raw.size} bytes are not whole {kind} blocks")
    count = raw.size // form.size
    out = torch.empty(count * form.weights, dtype=torch.float32)
    status = library.handle.sf_dequantize(form.ggml_type, raw.ctypes.data, count, out.data_ptr())
    if status:
        raise RuntimeError(f"sf_dequantize refused {kind} (status {status})")
    return out


def blocks_weight(blocks: torch.Tensor, cols: int) -> torch.Tensor:
    """The float32 weights Q4_1 ``blocks`` mean (``d*q + m``), ``[rows, cols]``."""
    rows = blocks.shape[0]
    raw = blocks.numpy().reshape(rows, cols // BLOCK, BLOCK_BYTES)
    d = np.ascontiguousarray(raw[..., 0:2]).view(np.float16)[..., 0].astype(np.float32)
    m = np.ascontiguousarray(raw[..., 2:4]).view(np.float16)[..., 0].astype(np.float32)
    packed = raw[..., 4:]
    q = np.concatenate([packed & 0x0F, packed >> 4], axis=-1).astype(np.float32)
    w = q * d[..., None] + m[..., None]
    return torch.from_numpy(w.reshape(rows, cols))


TILE_ROWS = 8
TILE_BYTES = 160
"""A tile: 8 output rows' Q4_1 blocks for the same 32 inputs, laid out for the kernel."""


def tile_shape(rows: int, cols: int) -> tuple[int, int]:
    """The shape of the tiles of a ``[rows, cols]`` Q4_1 matrix: a row of tiles per 8 rows."""
    return (-(-rows // TILE_ROWS), cols // BLOCK * TILE_BYTES)


def _linear(
    function: Any, matrix: _Matrix, x: torch.Tensor, out_features: int, *form: int
) -> torch.Tensor:
    if x.dtype != torch.float32:
        x = x.to(torch.float32)
    x = x.contiguous()
    rows = x.shape[0]
    out = torch.empty((rows, out_features), dtype=torch.float32)
    status = function(
        ctypes.byref(matrix), x.data_ptr(), rows, out.data_ptr(), torch.get_num_threads(), *form
    )
    if status:
        raise RuntimeError(f"the native kernel refused the problem (status {status})")
    return out


def tile_loops_fused(library: Library) -> bool:
    """Whether the tile loops run in their vpdpwssd form here (a CPU with AVX512-VNNI and
    AVX512-VL; docs/engine.md section 5.4): the same results as their AVX2 form, bit for bit."""
    return bool(library.handle.sf_vnni())


def avx2_form(layer: Any, x: torch.Tensor) -> torch.Tensor:
    """``layer(x)`` (a native product: ``Q4Linear``, ``BlockLinear``, ...) with the tile loops in
    their AVX2 form whatever the CPU: what the vpdpwssd form must give bit for bit."""
    function = layer.library.handle.sf_linear_form
    return _linear(function, layer.matrix, x, layer.out_features, 1)


class _Part(ctypes.Structure):
    _fields_ = [
        ("kind", ctypes.c_int32),
        ("K", ctypes.c_int32),
        ("N", ctypes.c_int32),
        ("w", ctypes.c_void_p),
        ("scales", ctypes.c_void_p),
    ]


MAX_PARTS = 3


class _Matrix(ctypes.Structure):
    """The C view of a matrix: one or more parts stacked along the rows (``sf_matrix``)."""

    _fields_ = [
        ("parts", ctypes.c_int32),
        ("K", ctypes.c_int32),
        ("N", ctypes.c_int32),
        ("part", _Part * MAX_PARTS),
    ]


def _matrix(*parts: _Part) -> _Matrix:
    """A matrix of ``parts`` (same inputs, their rows one after the other)."""
    if not 1 <= len(parts) <= MAX_PARTS:
        raise ValueError(f"a matrix of {len(parts)} parts")
    return _Matrix(len(parts), parts[0].K, sum(p.N for p in parts), (_Part * MAX_PARTS)(*parts))


class Q4Linear:
    """4-bit weights in Q4_1 blocks, held as the kernel's tiles, multiplied by the native
    library's kernel; float32 activations (quantized per row and block of 32 to int16 inside).

    Its precision is int4 (what the weights hold); it computes in float32 between matrices.
    """

    precision = Precision.INT4
    activations = torch.float32
    kernel_name = "sfnode q4 tiles x int16 (avx2)"

    def __init__(
        self,
        blocks: torch.Tensor | None,
        in_features: int,
        library: Library,
        *,
        tiles: torch.Tensor | None = None,
        out_features: int | None = None,
    ) -> None:
        """From row-major Q4_1 ``blocks`` ``[rows, in_features / 32 * 20]``, or from ``tiles``
        laid out already (with ``out_features``)."""
        if in_features % BLOCK:
            raise ValueError(f"Q4_1 blocks need in_features divisible by {BLOCK}")
        self.in_features = in_features
        self.library = library
        if tiles is None:
            assert blocks is not None
            self.out_features = int(blocks.shape[0])
            blocks = blocks.contiguous()
            tiles = torch.empty(tile_shape(self.out_features, in_features), dtype=torch.uint8)
            library.handle.sf_tile_q4(
                blocks.data_ptr(), self.out_features, in_features, tiles.data_ptr()
            )
        else:
            assert out_features is not None
            if tuple(tiles.shape) != tile_shape(out_features, in_features):
                raise ValueError(f"tiles of shape {tuple(tiles.shape)} for {out_features} rows")
            self.out_features = out_features
        self.tiles = tiles.contiguous()
        self.matrix = _matrix(_Part(0, in_features, self.out_features, self.tiles.data_ptr()))
        self._function = library.handle.sf_linear

    @property
    def blocks(self) -> torch.Tensor:
        """The row-major Q4_1 blocks these tiles hold (a copy)."""
        blocks = torch.empty(
            (self.out_features, self.in_features // BLOCK * BLOCK_BYTES), dtype=torch.uint8
        )
        self.library.handle.sf_untile_q4(
            self.tiles.data_ptr(), self.out_features, self.in_features, blocks.data_ptr()
        )
        return blocks

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return _linear(self._function, self.matrix, x, self.out_features)

    def state(self) -> dict[str, torch.Tensor]:
        return {
            "tiles": self.tiles,
            "in_features": torch.tensor(self.in_features),
            "out_features": torch.tensor(self.out_features),
        }


class Q8Linear:
    """Int8 weights with one float32 scale per output row, multiplied by the native library's
    kernel (activations quantized per block of 32 as for :class:`Q4Linear`); float32
    activations."""

    precision = Precision.INT8
    activations = torch.float32
    kernel_name = "sfnode q8 x int16 (avx2)"

    def __init__(self, weight: torch.Tensor, scales: torch.Tensor, library: Library) -> None:
        self.weight = weight.to(torch.int8).contiguous()
        self.scales = scales.to(torch.float32).contiguous()
        self.out_features, self.in_features = self.weight.shape
        if self.in_features % BLOCK:
            raise ValueError(f"the q8 kernel needs in_features divisible by {BLOCK}")
        self.library = library
        self.matrix = _matrix(
            _Part(
                1,
                self.in_features,
                self.out_features,
                self.weight.data_ptr(),
                self.scales.data_ptr(),
            )
        )
        self._function = library.handle.sf_linear

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return _linear(self._function, self.matrix, x, self.out_features)

    def state(self) -> dict[str, torch.Tensor]:
        return {"weight": self.weight, "scales": self.scales}


class F32Linear:
    """Float32 weights multiplied by the native library's kernel: float32 products summed in a
    fixed order per row (8 lanes along the row, then their sum), so a row's result does not
    depend on the rows beside it."""

    precision = Precision.FLOAT32
    activations = torch.float32
    kernel_name = "sfnode float32 (avx2)"

    def __init__(self, weight: torch.Tensor, library: Library) -> None:
        self.weight = weight.to(torch.float32).contiguous()
        self.out_features, self.in_features = self.weight.shape
        self.library = library
        self.matrix = _matrix(_Part(2, self.in_features, self.out_features, self.weight.data_ptr()))
        self._function = library.handle.sf_linear

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return _linear(self._function, self.matrix, x, self.out_features)

    def state(self) -> dict[str, torch.Tensor]:
        return {"weight": self.weight}


STORED_KINDS = {"Q8_0": 3, "Q4_K": 4, "Q5_K": 5, "Q6_K": 6, "Q5_0": 7, "Q5_1": 8}
"""The formats the kernels multiply as the file stores them, by their number in ``sf_part``."""
TILED_KINDS = {
    "Q5_0": (9, 176, "q5"),
    "Q8_0": (10, 272, "q8"),
    "Q4_K": (11, 1152, "q4k"),
    "Q6_K": (12, 1680, "q6k"),
}
"""The formats laid out at load in tiles of 8 output rows by one block of inputs (32; 256 for
the K-quants' super-blocks): their number in ``sf_part``, a tile's bytes, and the name of their
``sf_tile_*`` / ``sf_untile_*``."""


class BlockLinear:
    """A matrix multiplied in the file's blocks (Q8_0, Q5_0, Q5_1, Q4_K, Q5_K or Q6_K rows of
    blocks, docs/engine.md section 5.4): the kernel reads each block of 32 weights (a Q8_0 or
    Q5 block, a K-quant sub-block) against the int16 activations of the same inputs, in
    integers, and scales it in float; nothing is inflated.  Q5_0 and Q8_0 blocks are laid out
    at load in tiles of 8 output rows (``sf_tile_q5``, ``sf_tile_q8``: the same bytes, moved;
    the file's map is read once), and so are Q4_K and Q6_K super-blocks (``sf_tile_q4k``,
    ``sf_tile_q6k``), unless ``tiled`` is false (the head, whose float rows are read from the
    same map: tiles would be a second copy); the others are multiplied as stored (``data`` is
    the file's map)."""

    activations = torch.float32
    as_stored = True
    """Read from the file at every start: never kept with the packed weights."""

    def __init__(
        self,
        kind: str,
        data: np.ndarray[Any, Any],
        in_features: int,
        library: Library,
        *,
        tiled: bool = True,
    ) -> None:
        from sfnode.engines.kernels.blocks import FORMATS

        if kind not in STORED_KINDS:
            raise ValueError(f"the native kernels do not multiply {kind} as stored")
        form = FORMATS[kind]
        self.kind = self.label = kind
        """The format, which the log names (``Q4_K x 12``)."""
        self.precision = Precision.INT8 if kind in ("Q8_0", "Q6_K") else Precision.INT4
        self.in_features = in_features
        self.held = np.ascontiguousarray(data, dtype=np.uint8)
        if self.held.shape != (self.held.shape[0], form.row_bytes(in_features)):
            raise ValueError(f"{kind} rows of {self.held.shape[1]} bytes for {in_features} inputs")
        self.out_features = int(self.held.shape[0])
        self.library = library
        number = STORED_KINDS[kind]
        self.tiled = tiled and kind in TILED_KINDS
        if self.tiled:
            number, tile_bytes, name = TILED_KINDS[kind]
            inputs = form.weights
            rows, width = -(-self.out_features // TILE_ROWS), in_features // inputs * tile_bytes
            tiles = np.empty((rows, width), dtype=np.uint8)
            getattr(library.handle, f"sf_tile_{name}")(
                self.held.ctypes.data, self.out_features, in_features, tiles.ctypes.data
            )
            # The tiles hold these bytes now: the map's pages that laying them out read
            # would stay resident beside them (only this matrix's; others are read from it).
            give_back(data)
            self.held = tiles
        self.matrix = _matrix(_Part(number, in_features, self.out_features, self.held.ctypes.data))
        self._function = library.handle.sf_linear

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return _linear(self._function, self.matrix, x, self.out_features)

    def weight(self) -> torch.Tensor:
        """The float32 weights the file means (a copy, for checks and tests)."""
        from sfnode.engines.kernels.blocks import dequantize

        return torch.from_numpy(dequantize(self.kind, self.blocks(), self.in_features))

    def blocks(self) -> np.ndarray[Any, Any]:
        """The matrix's rows of blocks as the file stores them (from the tiles, a copy)."""
        if not self.tiled:
            return self.held
        from sfnode.engines.kernels.blocks import FORMATS

        rows = np.empty(
            (self.out_features, FORMATS[self.kind].row_bytes(self.in_features)), dtype=np.uint8
        )
        getattr(self.library.handle, f"sf_untile_{TILED_KINDS[self.kind][2]}")(
            self.held.ctypes.data, self.out_features, self.in_features, rows.ctypes.data
        )
        return rows

    def state(self) -> dict[str, torch.Tensor]:
        raise TypeError("a matrix multiplied as stored is read from its file, never kept")


class NativeParts(JoinedLinear):
    """A projection of parts held in different formats (a Q4_K query beside a Q6_K value)
    multiplied in one call: the kernels write each part's outputs into its own columns."""

    def __init__(self, parts: Sequence[Any], library: Library) -> None:
        super().__init__(parts)
        self.matrix = _matrix(*(part.matrix.part[0] for part in parts))
        self._function = library.handle.sf_linear

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return _linear(self._function, self.matrix, x, self.out_features)


NativeLinear = Q4Linear | Q8Linear | F32Linear | BlockLinear | NativeParts


class _Layer(ctypes.Structure):
    _fields_ = [
        ("input_norm", ctypes.c_void_p),
        ("post_norm", ctypes.c_void_p),
        ("qkv", _Matrix),
        ("o", _Matrix),
        ("gate_up", _Matrix),
        ("down", _Matrix),
        ("cos", ctypes.c_void_p),
        ("sin", ctypes.c_void_p),
        ("rope_dims", ctypes.c_int32),
        ("window", ctypes.c_int32),
        ("qkv_bias", ctypes.c_void_p),
        ("o_bias", ctypes.c_void_p),
        ("gate_up_bias", ctypes.c_void_p),
        ("down_bias", ctypes.c_void_p),
        ("q_norm", ctypes.c_void_p),
        ("k_norm", ctypes.c_void_p),
        ("attn_post_norm", ctypes.c_void_p),
        ("mlp_post_norm", ctypes.c_void_p),
    ]


class _Model(ctypes.Structure):
    _fields_ = [
        ("layers", ctypes.c_int32),
        ("hidden", ctypes.c_int32),
        ("heads", ctypes.c_int32),
        ("kv_heads", ctypes.c_int32),
        ("head_dim", ctypes.c_int32),
        ("intermediate", ctypes.c_int32),
        ("vocab", ctypes.c_int32),
        ("eps", ctypes.c_float),
        ("attention_scale", ctypes.c_float),
        ("layer", ctypes.c_void_p),
        ("embed_type", ctypes.c_int32),
        ("embed", ctypes.c_void_p),
        ("final_norm", ctypes.c_void_p),
        ("head", _Matrix),
        ("refine_type", ctypes.c_int32),
        ("refine", ctypes.c_void_p),
        ("attn_softcap", ctypes.c_float),
        ("final_softcap", ctypes.c_float),
        ("embed_scale", ctypes.c_float),
        ("activation", ctypes.c_int32),
        ("embed_fd", ctypes.c_int32),
        ("embed_at", ctypes.c_int64),
        ("refine_fd", ctypes.c_int32),
        ("refine_at", ctypes.c_int64),
    ]


class _KV(ctypes.Structure):
    _fields_ = [
        ("half", ctypes.c_int32),
        ("capacity", ctypes.c_int32),
        ("keys", ctypes.c_void_p),
        ("values", ctypes.c_void_p),
    ]


MAX_HEAD_DIM = 256
ACTIVATIONS = ("silu", "gelu_tanh")
"""The gated MLP's activations the step computes, by the number ``sf_model`` holds."""


def fusable(weights: Any) -> str | None:
    """None when ``weights`` (a ``ModelWeights``) can run through :class:`NativeStep`, else why
    not."""
    from sfnode.engines.kernels.quant import StoredRows

    if weights.activations != torch.float32:
        return f"activations are {str(weights.activations).removeprefix('torch.')}"
    if weights.head_dim > MAX_HEAD_DIM or weights.head_dim % 8:
        return f"head_dim {weights.head_dim} is not supported"
    if weights.heads % weights.kv_heads:
        return "the query heads do not group evenly onto the key/value heads"
    intermediate = weights.intermediate
    if weights.hidden % BLOCK or intermediate % BLOCK or (weights.heads * weights.head_dim) % BLOCK:
        return f"a dimension is not a multiple of {BLOCK}"
    for layer in weights.layers:
        for projection in (layer.qkv, layer.o, layer.gate_up, layer.down):
            if not isinstance(projection.kernel, NativeLinear):
                return f"a {projection.kernel.precision.value} matrix has no native kernel"
            if projection.dense is not None:
                return "a projection has a dense copy"
    if not isinstance(weights.lm_head, NativeLinear):
        return "the output head has no native kernel"
    for table in (weights.embed, weights.lm_head_float):
        if table is not None and not isinstance(table, StoredRows | torch.Tensor):
            return f"a table of rows held as {type(table).__name__} has no native reader"
    return None


def _rows_pointers(table: Any, from_file: bool) -> tuple[int, int, int, int, list[Any]]:
    """(ggml type, rows, file descriptor, offset of row 0 in the file, things to keep) of an
    embedding table or the head's float rows: the file's own rows read a row at a time (their
    format's type), with ``from_file`` read from the file with ``pread`` where the table has
    its file (:class:`~sfnode.engines.kernels.maps.RowFile`; else descriptor -1: through the
    map), or float32 rows (type 0)."""
    from sfnode.engines.kernels.quant import StoredRows

    if isinstance(table, StoredRows):
        rows = np.ascontiguousarray(table.data, dtype=np.uint8)
        file = table.file if from_file else None
        if file is None:
            return table.ggml_type, rows.ctypes.data, -1, 0, [rows]
        return table.ggml_type, rows.ctypes.data, file.fd, file.offset, [rows, file]
    floats = table.to(torch.float32).contiguous()
    return 0, floats.data_ptr(), -1, 0, [floats]


class RotaryTables(Protocol):
    """Each layer's rotary tables, grown on demand
    (:class:`~sfnode.engines.runners.decoder.RopeTables`)."""

    def cover(self, positions: int) -> Sequence[tuple[torch.Tensor, torch.Tensor]]:
        """Each layer's ``(cos, sin)`` of at least ``positions`` positions."""
        ...


class NativeStep:
    """The whole decode step of a Llama-family model in two calls into the native library
    (docs/engine.md section 5.2): :meth:`forward` (every layer over any rows, attention over the
    KV slots included) and :meth:`logits` (the final norm, the head, the best logits computed
    again in float32).

    Every row is computed by itself, so it is batch-invariant like the kernels, and a
    position's keys and values do not depend on the step it was computed in.  The weights'
    tensors must outlive this object (it holds their addresses; ``weights`` keeps them).
    """

    def __init__(self, weights: Any, library: Library, tables: RotaryTables) -> None:
        """``tables`` gives each layer's rotary tables ``(cos, sin)``, ``[positions, rotated
        dimensions]`` (``sin`` with rotate_half's sign folded in), float32, layers of one rope
        sharing theirs, of at least the positions a step's keys and values hold
        (:meth:`RotaryTables.cover`, asked at every :meth:`forward`)."""
        reason = fusable(weights)
        if reason is not None:
            raise ValueError(reason)
        self._weights = weights
        self._keep: list[Any] = []
        self._tables = tables
        self._bound: list[tuple[torch.Tensor, torch.Tensor]] = []
        """The tables the layers point at (float32 copies where ``tables``' are not)."""
        self._bound_from: list[tuple[torch.Tensor, torch.Tensor]] = []
        self._layers = (_Layer * len(weights.layers))()
        for index, layer in enumerate(weights.layers):
            cos, _ = tables.cover(0)[index]
            self._layers[index] = _Layer(
                self._float_pointer(layer.attn_norm),
                self._float_pointer(layer.mlp_norm),
                layer.qkv.kernel.matrix,
                layer.o.kernel.matrix,
                layer.gate_up.kernel.matrix,
                layer.down.kernel.matrix,
                None,  # the tables: :meth:`_bind`
                None,
                int(cos.shape[1]),
                weights.spec.sliding_window or 0 if weights.spec.is_sliding(index) else 0,
                *(
                    self._optional_pointer(projection.bias)
                    for projection in (layer.qkv, layer.o, layer.gate_up, layer.down)
                ),
                self._optional_pointer(layer.q_norm),
                self._optional_pointer(layer.k_norm),
                self._optional_pointer(layer.attn_post_norm),
                self._optional_pointer(layer.mlp_post_norm),
            )
        self.hidden = int(weights.hidden)
        self.vocab = int(weights.vocab_size)
        self.refines = weights.lm_head_float is not None
        """Whether :meth:`logits` computes each row's best logits again from float rows."""
        self._model = self._model_struct(weights)
        self._bind(0)
        self._forward = library.handle.sf_forward
        self._logits = library.handle.sf_logits
        self._kv: tuple[weakref.ref[Any], tuple[int, int], _KV, Any, Any] | None = None

    def _bind(self, positions: int) -> None:
        """Point each layer at rotary tables of at least ``positions`` positions (new ones
        where the tables grew; the previous ones are let go)."""
        tables = list(self._tables.cover(positions))
        if len(tables) == len(self._bound_from) and all(
            cos is was for (cos, _), (was, _) in zip(tables, self._bound_from, strict=True)
        ):
            return
        bound = []
        for index, (cos, sin) in enumerate(tables):
            cos, sin = cos.to(torch.float32).contiguous(), sin.to(torch.float32).contiguous()
            self._layers[index].cos, self._layers[index].sin = cos.data_ptr(), sin.data_ptr()
            bound.append((cos, sin))
        self._bound, self._bound_from = bound, tables

    def _float_pointer(self, tensor: torch.Tensor) -> int:
        """The address of ``tensor`` as contiguous float32, kept alive as long as this step."""
        tensor = tensor.to(torch.float32).contiguous()
        self._keep.append(tensor)
        return int(tensor.data_ptr())

    def _optional_pointer(self, tensor: torch.Tensor | None) -> int | None:
        """:meth:`_float_pointer`, or NULL for what the layer has not."""
        return None if tensor is None else self._float_pointer(tensor)

    def _rows_pointers(self, table: Any, from_file: bool) -> tuple[int, int, int, int]:
        """(ggml type, rows, file descriptor, offset) of a table of rows
        (:func:`_rows_pointers`), kept alive."""
        kind, rows, fd, offset, kept = _rows_pointers(table, from_file)
        self._keep += kept
        return kind, rows, fd, offset

    def _model_struct(self, weights: Any) -> _Model:
        """The C view of the whole model: sizes, the layers, the embedding, the head and the
        float rows it refines its best logits from (kind -1: none).  The tables read a row at a
        time (``weights.row_tables()``) are read from their file with ``pread``: through the
        map, each row read would map the pages around it (docs/engine.md section 5.3); a table
        the head's kernel multiplies whole from the map is read through the map."""
        spec = weights.spec
        by_file = {table.data.ctypes.data for table in weights.row_tables()}

        def from_file(table: Any) -> bool:
            data = getattr(table, "data", None)
            return isinstance(data, np.ndarray) and data.ctypes.data in by_file

        embed = self._rows_pointers(weights.embed, from_file(weights.embed))
        refine = (-1, 0, -1, 0)
        if weights.lm_head_float is not None:
            table = weights.lm_head_float
            refine = self._rows_pointers(table, from_file(table))
        return _Model(
            len(weights.layers),
            self.hidden,
            weights.heads,
            weights.kv_heads,
            weights.head_dim,
            weights.intermediate,
            self.vocab,
            weights.eps,
            weights.spec.attention_scale,
            ctypes.addressof(self._layers),
            *embed[:2],
            self._float_pointer(weights.final_norm_float),
            weights.lm_head.matrix,
            *refine[:2],
            spec.attn_softcap or 0.0,
            spec.final_softcap or 0.0,
            spec.embed_scale or 0.0,
            ACTIVATIONS.index(spec.activation),
            *embed[2:],
            *refine[2:],
        )

    def _kv_struct(self, kv: Any) -> _KV:
        """The C view of ``kv`` (a :class:`~sfnode.engines.runners.kv.SlotKV`), rebuilt when it
        grew or is another one.  The view is kept for the very object it was built from (a weak
        reference, not its ``id``): a pipeline stage's scratch KV is made anew for each call, and
        a new one can take a freed one's address and first buffer while its other layers' buffers
        lie elsewhere, so a view matched by address would send the step's writes into freed
        memory."""
        key = (kv.capacity, kv.keys[0].data_ptr() if kv.keys else 0)
        if self._kv is None or self._kv[0]() is not kv or self._kv[1] != key:
            layers = len(kv.keys)
            keys = (ctypes.c_void_p * layers)(*[t.data_ptr() for t in kv.keys])
            values = (ctypes.c_void_p * layers)(*[t.data_ptr() for t in kv.values])
            if kv.dtype not in (torch.float16, torch.float32):
                raise ValueError(f"keys and values in {kv.dtype} are not supported")
            struct = _KV(
                int(kv.dtype == torch.float16),
                kv.capacity,
                ctypes.addressof(keys),
                ctypes.addressof(values),
            )
            self._kv = (weakref.ref(kv), key, struct, keys, values)
        return self._kv[2]

    def forward(
        self,
        kv: Any,
        positions: Sequence[int],
        slots: Sequence[int],
        *,
        tokens: Sequence[int] | None = None,
        hidden: torch.Tensor | None = None,
        first: int = 0,
        end: int | None = None,
    ) -> torch.Tensor:
        """Layers ``[first, end)`` over rows at ``positions`` of ``slots`` of ``kv``, from the
        ``tokens``' embeddings or from ``hidden`` (float32 ``[rows, hidden]``, changed in
        place); answers the hidden states after the last of them.  Each row's key and value
        go to its position of its slot; each row attends to its slot up to its position."""
        rows = len(positions)
        end = len(self._weights.layers) if end is None else end
        self._bind(kv.capacity)
        if hidden is None:
            if tokens is None:
                raise ValueError("forward needs tokens or hidden states")
            hidden = torch.empty((rows, self.hidden), dtype=torch.float32)
            token_array = np.asarray(tokens, dtype=np.int64)
            token_pointer = token_array.ctypes.data
        else:
            token_pointer = None
        position_array = np.asarray(positions, dtype=np.int64)
        slot_array = np.asarray(slots, dtype=np.int64)
        if rows and (int(slot_array.min()) < 0 or int(slot_array.max()) >= kv.slots):
            raise ValueError("a row's slot is outside the KV slots")
        status = self._forward(
            ctypes.byref(self._model),
            ctypes.byref(self._kv_struct(kv)),
            rows,
            token_pointer,
            position_array.ctypes.data,
            slot_array.ctypes.data,
            hidden.data_ptr(),
            first,
            end,
            torch.get_num_threads(),
        )
        if status:
            raise RuntimeError(f"the native step refused the problem (status {status})")
        return hidden

    def logits(
        self, hidden: torch.Tensor, masks: np.ndarray[Any, Any] | None = None, refined: int = 0
    ) -> torch.Tensor:
        """Float32 logits ``[rows, vocab]`` of ``hidden`` rows (after the last layer): the head's
        product, and with :attr:`refines` the best ``refined`` of each row computed again from
        the head's float rows.  ``masks`` (int32 words a row, bit ``t % 32`` of word ``t // 32``
        allowing token ``t``) makes forbidden tokens -inf, and the refined ones the best
        allowed ones."""
        hidden = hidden.to(torch.float32).contiguous()
        rows = hidden.shape[0]
        out = torch.empty((rows, self.vocab), dtype=torch.float32)
        words = 0
        mask_pointer = None
        if masks is not None:
            masks = np.ascontiguousarray(masks, dtype=np.int32)
            words = int(masks.shape[1])
            mask_pointer = masks.ctypes.data
        status = self._logits(
            ctypes.byref(self._model),
            rows,
            hidden.data_ptr(),
            mask_pointer,
            words,
            refined if self.refines else 0,
            out.data_ptr(),
            torch.get_num_threads(),
        )
        if status:
            raise RuntimeError(f"the native head refused the problem (status {status})")
        return out


__all__ = [
    "NEEDED_FLAGS",
    "F32Linear",
    "Library",
    "NativeStep",
    "Q4Linear",
    "Q8Linear",
    "avx2_form",
    "blocks_weight",
    "compiler",
    "cpu_flags",
    "fusable",
    "gguf_blocks",
    "load",
    "pack_blocks",
    "tile_loops_fused",
]
