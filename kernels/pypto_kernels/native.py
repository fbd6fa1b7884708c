"""CPU kernels written in C (``csrc/``), compiled at first use by the system C compiler, called through ctypes.

The library is built once per source, compiler and CPU (``-O3 -march=native -fopenmp``) into
:func:`cache_dir` and loaded into the process, where its OpenMP parallel regions run on the
runtime torch already loaded (the same ``libgomp.so.1``), so they share torch's threads and never
add a second pool competing for the cores. Where no C compiler is found, or
``PYPTO_KERNELS_NATIVE=0``, :func:`library` is None and the callers keep their torch paths (the
same results to float rounding), saying so once in the log.

- :func:`paged_attention`: query rows over a paged float32 or bfloat16 K/V cache read in place
  (``csrc/paged_attention.c``), one pass per (row, KV head) over the keys the row sees.
- :func:`prefill_attention`: long causal query runs (prefill chunks) over the same caches
  (``csrc/prefill_attention.c``), flash-attention style: tiles of queries share each packed chunk of
  keys and values.
- :func:`hc_sinkhorn_mix`: DeepSeek-V4's hyper-connection weights from their projected logits
  (``csrc/hyper_connections.c``), one pass per token instead of about 80 tensor ops.
- :func:`gemv`: one activation row times a plain ``[out, in]`` matrix (``csrc/gemv.c``), a
  stream over the matrix with software prefetches (a tied output projection's one row beside a
  oneDNN copy; beside the panels one row runs the panels, whose sums do not depend on the batch).
- :func:`grouped_gemv`: rows sorted by expert times each expert's plain ``[out, in]`` matrix
  (``csrc/gemv.c``): a mixture of experts' routed products, each expert's matrix read once for all
  its rows.
- :func:`panel_linear`: float32 or bfloat16 rows times a matrix held as column panels (:func:`pack_panels`,
  ``csrc/panel_gemm.c``): every linear layer's product where :func:`pypto_kernels.packing_rule` picks
  it, one layout serving a one-row step (a stream over the matrix) and a 64-row one (tiles of fused
  multiply-adds), each output's sum in one fixed order whatever the batch and the threads.
- :func:`rms_norm`, :func:`qk_norm_rope_write_kv` and :func:`silu_mul`: the element-wise work between
  a decoder layer's matrix products (``csrc/norm_rope.c``): the residual add and RMSNorm of each row,
  the q/k head norms, the rotation and the K/V cache write of an attention's fused projection, and
  SwiGLU, one pass each instead of a dozen torch ops.
- :func:`moe_block`: a mixture of experts' routed block (``csrc/moe.c``): the router's product,
  softmax top-k routing, both grouped expert products and the weighted sum in one call.
- ``csrc/decode_layers.c``: a decode step's decoder layers calling the kernels above in one
  call (:class:`pypto_kernels.NativeDecoder`).
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch

from .device import avx2_without_avx512, cpu_flags

__all__ = [
    "MOE_ROUTES_PER_EXPERT",
    "NATIVE_DTYPES",
    "PANEL_WIDTH",
    "PackedExperts",
    "SampleDraw",
    "bf16_dot_available",
    "blocked_attention_available",
    "cache_dir",
    "expert_operands",
    "gemv",
    "gemv_holds_activation",
    "gemv_takes",
    "grouped_gemv",
    "grouped_gemv_takes",
    "grouped_panel_linear",
    "hc_sinkhorn_mix",
    "hc_takes",
    "library",
    "moe_block",
    "moe_block_takes",
    "norm_takes",
    "pack_experts",
    "pack_panels",
    "paged_attention",
    "panel_linear",
    "panel_takes",
    "prefill_attention",
    "prefill_routed",
    "prefill_takes",
    "qk_norm_rope_write_kv",
    "qk_rope_takes",
    "reads",
    "reads_dtypes",
    "rms_norm",
    "sample_rows",
    "sample_rows_takes",
    "sample_uniforms",
    "silu_mul",
    "silu_takes",
    "unpack_panels",
]

logger = logging.getLogger("pypto_kernels")

_CSRC = Path(__file__).with_name("csrc")
_SOURCES = tuple(
    _CSRC / name
    for name in (
        "paged_attention.c", "prefill_attention.c", "hyper_connections.c", "norm_rope.c", "gemv.c", "panel_gemm.c",
        "decode_layers.c", "moe.c", "sample.c",
    )
)  # fmt: skip
_HEADERS = (_CSRC / "common.h",)
# A warning never fails the build (another compiler's new warnings would turn the fast path off); a
# call to an undeclared function does (it would fail only when loaded).
_FLAGS = (
    "-O3", "-march=native", "-fopenmp", "-fno-math-errno", "-Wall", "-Wno-psabi",
    "-Werror=implicit-function-declaration", "-shared", "-fPIC",
)  # fmt: skip
#: Cache dtypes the C kernels read (bfloat16 widened exactly to float32 as it is read).
NATIVE_DTYPES = {torch.float32: 0, torch.bfloat16: 1}

_I64 = ctypes.c_int64
_PTR = ctypes.c_void_p


def cache_dir() -> Path:
    """Where built libraries are kept: ``$PYPTO_KERNELS_CACHE``, else ``$XDG_CACHE_HOME/pypto_kernels``
    (``~/.cache/pypto_kernels``), else, for a user without a home directory (a container's arbitrary
    user id), the system's temporary directory."""
    explicit = os.environ.get("PYPTO_KERNELS_CACHE")
    if explicit:
        return Path(explicit)
    xdg = os.environ.get("XDG_CACHE_HOME")
    if xdg:
        return Path(xdg) / "pypto_kernels"
    try:
        return Path.home() / ".cache" / "pypto_kernels"
    except RuntimeError:  # no $HOME and no password entry for this user
        return Path(tempfile.gettempdir()) / f"pypto_kernels_{os.getuid()}"


def _private_dir(path: Path) -> Path:
    """``path``, created (mode 0700) where missing. OSError: it is not this user's own or others may write
    to it, since a library found there is loaded into the process (another user could plant one in a
    shared temporary directory)."""
    path.mkdir(mode=0o700, parents=True, exist_ok=True)
    info = path.stat()
    if info.st_uid != os.getuid() or info.st_mode & 0o022:
        raise OSError(f"{path} is not a directory of this user's that only it may write (mode {info.st_mode:o})")
    return path


def _compiler() -> str | None:
    return os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")


def _build(compiler: str) -> Path:
    """The library for this source, compiler and CPU, compiled unless already in the cache."""
    version = subprocess.run([compiler, "--version"], capture_output=True, text=True, check=True).stdout
    key = hashlib.sha256()
    for part in (*(s.read_bytes() for s in (*_SOURCES, *_HEADERS)), " ".join(_FLAGS).encode(), version.encode()):
        key.update(part)
    key.update(" ".join(sorted(cpu_flags())).encode() + platform.machine().encode())
    target = _private_dir(cache_dir()) / f"pypto_native_{key.hexdigest()[:16]}.so"
    if target.exists():
        return target
    # Built beside the target and renamed into place, so concurrent processes never load half a file.
    fd, partial = tempfile.mkstemp(suffix=".so", dir=target.parent)
    os.close(fd)
    try:
        subprocess.run([compiler, *_FLAGS, "-o", partial, *map(str, _SOURCES)], capture_output=True, check=True)
        os.replace(partial, target)
    finally:
        if os.path.exists(partial):
            os.unlink(partial)
    return target


@functools.cache
def library() -> ctypes.CDLL | None:
    """The loaded C kernels, built on the first call; None (logged once, with the reason) where they
    cannot be: ``PYPTO_KERNELS_NATIVE=0``, no C compiler, a failed build."""
    if os.environ.get("PYPTO_KERNELS_NATIVE", "1") == "0":
        logger.info("native CPU kernels off (PYPTO_KERNELS_NATIVE=0): torch paths")
        return None
    compiler = _compiler()
    if compiler is None:
        logger.warning("no C compiler (cc, gcc or $CC): the native CPU kernels are off, torch paths run (slower)")
        return None
    try:
        path = _build(compiler)
        lib = ctypes.CDLL(str(path))
    except (OSError, subprocess.CalledProcessError) as e:
        detail = e.stderr.decode(errors="replace")[-2000:] if isinstance(e, subprocess.CalledProcessError) else e
        logger.warning("building the native CPU kernels with %s failed, torch paths run (slower): %s", compiler, detail)
        return None
    lib.pypto_paged_attention.restype = ctypes.c_int
    lib.pypto_paged_attention.argtypes = [
        _PTR, _I64, _I64, _PTR, _PTR, ctypes.c_int, _PTR, _PTR, _PTR, _I64, _PTR, _PTR, _PTR, _PTR, _I64,
        _I64, _I64, _I64, _I64, _I64, ctypes.c_float, _PTR, _PTR, ctypes.c_int, _I64, _I64, _PTR, ctypes.c_int,
        ctypes.c_int,
    ]  # fmt: skip
    lib.pypto_attention_blocked.restype = ctypes.c_int
    lib.pypto_attention_blocked.argtypes = []
    lib.pypto_prefill_attention.restype = ctypes.c_int
    lib.pypto_prefill_attention.argtypes = [
        _PTR, ctypes.c_int, _I64, _I64, _PTR, _PTR, ctypes.c_int, _PTR, _PTR, _PTR, _I64, _PTR, _I64, _I64, _I64,
        _I64, _I64, _I64, _I64, ctypes.c_float, _PTR, _PTR, ctypes.c_int, _I64, _I64, ctypes.c_int,
    ]  # fmt: skip
    lib.pypto_bf16_dot.restype = ctypes.c_int
    lib.pypto_bf16_dot.argtypes = []
    lib.pypto_gemv_held.restype = ctypes.c_int
    lib.pypto_gemv_held.argtypes = [ctypes.c_int, _I64]
    lib.pypto_hc_sinkhorn_mix.restype = ctypes.c_int
    lib.pypto_hc_sinkhorn_mix.argtypes = [
        _PTR, _I64, _PTR, ctypes.c_int, _I64, _I64, _I64, _I64, _I64, _PTR, _PTR, ctypes.c_int, ctypes.c_float,
        _PTR, _PTR, _PTR, ctypes.c_int,
    ]  # fmt: skip
    lib.pypto_rms_norm.restype = None
    lib.pypto_rms_norm.argtypes = [
        _PTR, _I64, _PTR, _I64, _PTR, ctypes.c_int, _I64, _I64, ctypes.c_float, _PTR, _I64, _PTR, _I64, ctypes.c_int,
    ]  # fmt: skip
    lib.pypto_qk_norm_rope_write.restype = ctypes.c_int
    lib.pypto_qk_norm_rope_write.argtypes = [
        _PTR, _I64, ctypes.c_int, _I64, _I64, _I64, _I64, _PTR, _PTR, ctypes.c_float, _PTR, _PTR, _I64, _I64, _PTR,
        _PTR, _PTR, ctypes.c_int, _PTR, _PTR, _I64, _I64, _PTR, ctypes.c_int,
    ]  # fmt: skip
    lib.pypto_silu_mul.restype = None
    lib.pypto_silu_mul.argtypes = [_PTR, _I64, ctypes.c_int, _I64, _I64, _PTR, _I64, ctypes.c_int]
    lib.pypto_decode_scratch_bytes.restype = _I64
    lib.pypto_decode_scratch_bytes.argtypes = [_PTR, _I64]
    lib.pypto_decode_layers.restype = ctypes.c_int
    lib.pypto_decode_layers.argtypes = [
        _PTR, _I64, _PTR, _PTR, _PTR, _I64, _PTR, _PTR, _I64, _PTR, _PTR, _I64, _PTR, _PTR, _PTR, ctypes.c_int,
    ]  # fmt: skip
    lib.pypto_greedy_run.restype = _I64
    lib.pypto_greedy_run.argtypes = [
        _PTR, _I64, _PTR, _PTR, _PTR, _PTR, _I64, _I64, _I64, _I64, _PTR, _I64, _PTR, ctypes.c_int32, _PTR, _PTR,
        _PTR, _PTR, ctypes.c_int,
    ]  # fmt: skip
    lib.pypto_sample_uniform.restype = ctypes.c_double
    lib.pypto_sample_uniform.argtypes = [_I64, _I64]
    lib.pypto_gemv.restype = ctypes.c_int
    lib.pypto_gemv.argtypes = [_PTR, ctypes.c_int, _I64, _PTR, _PTR, _I64, _I64, ctypes.c_int, _PTR, _PTR, ctypes.c_int]
    lib.pypto_grouped_gemv.restype = ctypes.c_int
    lib.pypto_grouped_gemv.argtypes = [
        _PTR, ctypes.c_int, _I64, _I64, _PTR, _PTR, _PTR, _I64, _I64, _I64, ctypes.c_int, ctypes.c_int,
    ]  # fmt: skip
    lib.pypto_panel_gemm.restype = None
    lib.pypto_panel_gemm.argtypes = [ctypes.c_int, _PTR, _I64, _PTR, _PTR, _PTR, _I64, _I64, _I64, _I64, ctypes.c_int]
    lib.pypto_panel_gemm_logits.restype = None
    lib.pypto_panel_gemm_logits.argtypes = [
        ctypes.c_int, _PTR, _I64, _PTR, _PTR, _PTR, _I64, _I64, _I64, _I64, _PTR, _PTR, ctypes.c_int,
    ]  # fmt: skip
    lib.pypto_moe_scratch_bytes.restype = _I64
    lib.pypto_moe_scratch_bytes.argtypes = [_I64, _I64, _I64, _I64, _I64]
    lib.pypto_moe_block.restype = ctypes.c_int
    lib.pypto_moe_block.argtypes = [
        ctypes.c_int, _PTR, _I64, _PTR, _PTR, _I64, _PTR, _I64, ctypes.c_int, _I64, _I64, _I64, _I64, _I64,
        ctypes.c_int, _PTR, _I64, _PTR, ctypes.c_int,
    ]  # fmt: skip
    lib.pypto_grouped_panel_gemm.restype = ctypes.c_int
    lib.pypto_grouped_panel_gemm.argtypes = [
        ctypes.c_int, _PTR, _I64, _PTR, _I64, _PTR, _I64, _PTR, _I64, _I64, _I64, ctypes.c_int,
    ]  # fmt: skip
    lib.pypto_sample_rows.restype = ctypes.c_int
    lib.pypto_sample_rows.argtypes = [_PTR, _I64, _PTR, _I64, _I64, _PTR, _PTR, _PTR, _PTR, _PTR, _PTR, ctypes.c_int]
    logger.info("native CPU kernels loaded from %s", path)
    return lib


def _element_strides(cache: torch.Tensor) -> ctypes.Array[ctypes.c_int64]:
    """The cache's block, token and head strides as a C array (no tensor made on the call's path)."""
    return (ctypes.c_int64 * 3)(*cache.stride()[:3])


def reads_dtypes(cache_dtype: torch.dtype, value_dtype: torch.dtype) -> bool:
    """Whether :func:`paged_attention` takes K/V caches of these dtypes here (the library built)."""
    return cache_dtype in NATIVE_DTYPES and value_dtype == cache_dtype and library() is not None


def reads(key_cache: torch.Tensor, value_cache: torch.Tensor, scaled: bool) -> bool:
    """Whether :func:`paged_attention` takes these caches (``scaled``: they carry dequantisation
    scales): CPU tensors of one dtype of :data:`NATIVE_DTYPES`, last dimension dense, and the library built."""
    return (
        key_cache.device.type == "cpu"
        and not scaled
        and key_cache.dim() == value_cache.dim() == 4
        and key_cache.stride(-1) == value_cache.stride(-1) == 1
        and reads_dtypes(key_cache.dtype, value_cache.dtype)
    )


def bf16_dot_available() -> bool:
    """Whether the built library has AVX512-BF16 dot products (it was compiled on a CPU with them)."""
    lib = library()
    return lib is not None and bool(lib.pypto_bf16_dot())


def gemv_holds_activation(dtype: torch.dtype, inputs: int) -> bool:
    """Whether :func:`gemv` holds the activation in registers for all the rows of a ``dtype`` matrix
    of ``inputs`` columns (``csrc/gemv.c``'s ``outputs_held``: bfloat16, 128 to 512 inputs in steps of
    128, a library built with AVX512-BF16), where it otherwise loads it again for every row. The
    outputs are the same bits either way."""
    lib = library()
    return lib is not None and dtype in NATIVE_DTYPES and bool(lib.pypto_gemv_held(NATIVE_DTYPES[dtype], inputs))


def blocked_attention_available() -> bool:
    """Whether the built library has the decode attention's blocked passes (it was compiled on a CPU
    with AVX-512): 16 keys' scores summed at once and the value sums in registers."""
    lib = library()
    return lib is not None and bool(lib.pypto_attention_blocked())


def _bf16_dot_applies(query: torch.Tensor, key_cache: torch.Tensor, lib: ctypes.CDLL) -> bool:
    bf16 = query.dtype == key_cache.dtype == torch.bfloat16
    return bf16 and key_cache.shape[-1] % 32 == 0 and bool(lib.pypto_bf16_dot())


def paged_attention(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    tables: torch.Tensor,
    rows: torch.Tensor,
    scale: float,
    sinks: torch.Tensor | None,
    out: torch.Tensor | None = None,
    bf16_dot: bool = True,
    blocked: bool = True,
) -> torch.Tensor:
    """Query rows over the paged caches, read in place, into float32 or bfloat16 ``out`` ``[R, Hq, Dv]``
    (rows not named are left as they are).

    A bfloat16 query over a bfloat16 cache (head dim a multiple of 32) takes AVX512-BF16's pairwise
    dot products for the scores where the library has them (:func:`bf16_dot_available`): the same
    exact products as widening each key, summed in another order; ``bf16_dot=False`` widens instead.
    Where the library has the blocked passes (:func:`blocked_attention_available`) and the head dim
    is a multiple of 16 and the value head dim of 32, they run (16 keys' scores summed at once, the
    value sums in registers: the same products, summed in another order than the per-key passes);
    ``blocked=False`` runs the per-key passes.

    :param query: ``[R, Hq, D]`` (any float dtype; read as float32, or as it is where the bf16 dot
        product takes it).
    :param key_cache: ``[blocks, block_size, Hkv, D]``, a dtype of :data:`NATIVE_DTYPES`, last dimension
        dense, Hkv dividing Hq.
    :param value_cache: as ``key_cache`` with ``Dv`` values, same dtype.
    :param tables: ``[requests, max_blocks]`` block tables.
    :param rows: int64 ``[n, 4]``: per attended query row its row of ``query``, its request (row of
        ``tables``), the first key position it sees and how many keys (consecutive positions, at least
        one, within its table).
    :param sinks: per query head a logit added to the softmax's denominator (``[Hq]``), or None.
    :param out: a contiguous float32 or bfloat16 ``[R, Hq, Dv]`` to write (bfloat16: each float32 result
        rounded as ``.to(torch.bfloat16)`` rounds it; a new float32 zero tensor when None).
    :return: ``out``.
    """
    lib = library()
    if lib is None:
        raise RuntimeError("the native CPU kernels are not available (see the log)")
    # The bfloat16 dot product reads the query as it is: no float32 copy is made for it.
    query_bf16 = query.contiguous() if bf16_dot and _bf16_dot_applies(query, key_cache, lib) else None
    q = query_bf16 if query_bf16 is not None else query.to(torch.float32).contiguous()
    # Each a no-op for the int64 tables and _native_rows' transposed columns a decode step passes.
    tables = (tables if tables.dtype == torch.int64 else tables.to(torch.int64)).contiguous()
    columns = (rows if rows.dtype == torch.int64 else rows.to(torch.int64)).t().contiguous()
    if out is None:
        out = torch.zeros((q.shape[0], q.shape[1], value_cache.shape[-1]), dtype=torch.float32)
    if out.dtype not in NATIVE_DTYPES or not out.is_contiguous():
        raise ValueError(
            f"out must be a contiguous float32 or bfloat16 tensor, got {out.dtype} with strides {out.stride()}"
        )
    sink = None if sinks is None else sinks.to(torch.float32).contiguous()
    k_strides, v_strides = _element_strides(key_cache), _element_strides(value_cache)
    base, column_bytes = columns.data_ptr(), columns.stride(0) * columns.element_size()  # no select op per column
    status = lib.pypto_paged_attention(
        None if query_bf16 is not None else q.data_ptr(), q.stride(0), q.stride(1), key_cache.data_ptr(),
        value_cache.data_ptr(),
        NATIVE_DTYPES[key_cache.dtype], k_strides, v_strides, tables.data_ptr(),
        tables.stride(0), *(base + i * column_bytes for i in range(4)), columns.shape[1], q.shape[1],
        key_cache.shape[2], key_cache.shape[3], value_cache.shape[3], key_cache.shape[1], scale,
        None if sink is None else sink.data_ptr(), out.data_ptr(), NATIVE_DTYPES[out.dtype], out.stride(0),
        out.stride(1), None if query_bf16 is None else query_bf16.data_ptr(), int(not blocked), torch.get_num_threads(),
    )  # fmt: skip
    if status != 0:
        raise MemoryError("the native paged attention could not allocate its per-thread scratch")
    return out


def prefill_takes(value_cache: torch.Tensor) -> bool:
    """Whether :func:`prefill_attention` takes caches with this value head size (a multiple of 16)."""
    return value_cache.shape[-1] % 16 == 0


def prefill_routed(value_cache: torch.Tensor) -> bool:
    """Whether the paged attention sends its prefill runs over these caches to :func:`prefill_attention`:
    where it takes them (:func:`prefill_takes`) and the CPU is not an x86 one without AVX-512, where an
    AVX2 build run on the Zen 4 EPYC of docs/benchmarks.md took 3.3-6x the time of the torch path
    beside it (a 256- and a 1,024-token prompt, a 128-token chunk with 8 decodes; 16 / 8 heads of 128)."""
    return prefill_takes(value_cache) and not avx2_without_avx512(cpu_flags())


def prefill_attention(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    tables: torch.Tensor,
    spans: torch.Tensor,
    scale: float,
    window: int | None,
    sinks: torch.Tensor | None,
    out: torch.Tensor,
) -> torch.Tensor:
    """Causal runs of queries (prefill chunks) over the paged caches, read in place, into float32 or
    bfloat16 ``out`` ``[R, Hq, Dv]`` (rows not in a span are left as they are).

    Each run's query tiles share every chunk of keys and values (see ``csrc/prefill_attention.c``);
    a query's result depends only on its own inputs (not on its run's length, the batch or the
    threads), and equals the softmax reference to float32 rounding; where the library has AVX512-BF16
    dot products (:func:`bf16_dot_available`) and the query and the caches are bfloat16, the softmax's
    weights are rounded to bfloat16 before the values' product (as transformers' eager attention
    rounds them), each relative to the running maximum of its chunk of 64 positions.

    :param query: ``[R, Hq, D]`` (any float dtype; float32 and bfloat16 read as they are, others as a
        float32 copy).
    :param key_cache: ``[blocks, block_size, Hkv, D]``, a dtype of :data:`NATIVE_DTYPES`, last dimension
        dense, Hkv dividing Hq.
    :param value_cache: as ``key_cache`` with ``Dv`` values (a multiple of 16: :func:`prefill_takes`), same dtype.
    :param tables: ``[requests, max_blocks]`` block tables.
    :param spans: int64 ``[n, 5]``: per run its first row of ``query``, its request (row of ``tables``),
        its query count ``q``, the first key position any of its queries may see (``lo``) and one past
        its last query's position (``hi``); query ``i`` sits at ``hi - q + i`` and sees the keys from
        ``lo`` (or its window) up to itself.
    :param window: a sliding window in keys (each query sees its last ``window`` positions), or None.
    :param sinks: per query head a logit added to the softmax's denominator (``[Hq]``), or None.
    :param out: a contiguous float32 or bfloat16 ``[R, Hq, Dv]`` to write (bfloat16: each float32 result
        rounded as ``.to(torch.bfloat16)`` rounds it).
    :return: ``out``.
    """
    lib = library()
    if lib is None:
        raise RuntimeError("the native CPU kernels are not available (see the log)")
    if not prefill_takes(value_cache):
        size = value_cache.shape[-1]
        raise ValueError(f"the native prefill attention needs a value head size divisible by 16, got {size}")
    if out.dtype not in NATIVE_DTYPES or not out.is_contiguous():
        raise ValueError(
            f"out must be a contiguous float32 or bfloat16 tensor, got {out.dtype} with strides {out.stride()}"
        )
    q = (query if query.dtype in NATIVE_DTYPES else query.to(torch.float32)).contiguous()
    tables = tables.to(torch.int64).contiguous()
    spans = spans.to(torch.int64).contiguous()
    sink = None if sinks is None else sinks.to(torch.float32).contiguous()
    status = lib.pypto_prefill_attention(
        q.data_ptr(), NATIVE_DTYPES[q.dtype], q.stride(0), q.stride(1), key_cache.data_ptr(), value_cache.data_ptr(),
        NATIVE_DTYPES[key_cache.dtype], _element_strides(key_cache), _element_strides(value_cache),
        tables.data_ptr(), tables.stride(0), spans.data_ptr(), spans.shape[0], q.shape[1], key_cache.shape[2],
        key_cache.shape[3], value_cache.shape[3], key_cache.shape[1], window or 0, scale,
        None if sink is None else sink.data_ptr(), out.data_ptr(), NATIVE_DTYPES[out.dtype], out.stride(0),
        out.stride(1), torch.get_num_threads(),
    )  # fmt: skip
    if status != 0:
        raise MemoryError("the native prefill attention could not allocate its scratch")
    return out


#: The most streams :func:`hc_sinkhorn_mix` takes (DeepSeek-V4 has 4).
HC_MAX_STREAMS = 16


def hc_takes(streams: torch.Tensor) -> bool:
    """Whether :func:`hc_sinkhorn_mix` takes these streams: a CPU ``[T, N, D]`` tensor of a dtype of
    :data:`NATIVE_DTYPES`, at most :data:`HC_MAX_STREAMS` streams, last dimension dense, the library built."""
    return (
        streams.device.type == "cpu"
        and streams.dim() == 3
        and streams.dtype in NATIVE_DTYPES
        and streams.shape[1] <= HC_MAX_STREAMS
        and streams.stride(-1) == 1
        and library() is not None
    )


def hc_sinkhorn_mix(
    mixes: torch.Tensor,
    streams: torch.Tensor,
    base: torch.Tensor,
    scale: torch.Tensor,
    iters: int,
    eps: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """:func:`pypto_kernels.hc_sinkhorn_mix` after its projection, one C pass per token
    (``csrc/hyper_connections.c``): the reference's operations in its order, equal to it but for the
    exponential's last bits (the sigmoids and the softmax).

    :param mixes: float32 ``[T, N * (N + 2)]`` projected logits (pre, post, comb), rows dense.
    :param streams: ``[T, N, D]`` (:func:`hc_takes`).
    :param base: ``[N * (N + 2)]`` biases; ``scale``: ``[3]`` (pre, post, comb); both read as float32.
    :param iters: Sinkhorn rounds (the first is a column normalisation alone).
    :param eps: added to the pre weights, the softmax and every normalising sum.
    :return: ``(post [T, N], comb [T, N, N])`` float32 and ``collapsed [T, D]`` in the streams' dtype.
    """
    lib = library()
    if lib is None or not hc_takes(streams):
        raise ValueError(f"the native hc_sinkhorn_mix does not take streams {tuple(streams.shape)} {streams.dtype}")
    t, n, d = streams.shape
    if mixes.dtype != torch.float32 or mixes.shape != (t, n * (n + 2)) or mixes.stride(-1) != 1:
        raise ValueError(f"mixes must be float32 [{t}, {n * (n + 2)}] with dense rows, got {tuple(mixes.shape)}")
    base, scale = base.to(torch.float32).contiguous(), scale.to(torch.float32).contiguous()
    post = torch.empty((t, n), dtype=torch.float32)
    comb = torch.empty((t, n, n), dtype=torch.float32)
    collapsed = torch.empty((t, d), dtype=streams.dtype)
    lib.pypto_hc_sinkhorn_mix(
        mixes.data_ptr(), mixes.stride(0), streams.data_ptr(), NATIVE_DTYPES[streams.dtype], streams.stride(0),
        streams.stride(1), t, n, d, base.data_ptr(), scale.data_ptr(), iters, eps, post.data_ptr(),
        comb.data_ptr(), collapsed.data_ptr(), torch.get_num_threads(),
    )  # fmt: skip
    return post, comb, collapsed


#: The longest head :func:`qk_norm_rope_write_kv` takes (``PYPTO_MAX_HEAD_DIM`` in ``csrc/norm_rope.c``).
MAX_HEAD_DIM = 512


def _rows(x: torch.Tensor) -> tuple[int, int] | None:
    """``x`` as rows of its last dimension: (row count, row stride in elements), or None where its rows
    are not evenly strided with dense elements."""
    if x.dim() == 0 or x.stride(-1) != 1:
        return None
    if x.dim() == 1:
        return 1, x.shape[0]
    if x.dim() == 2:
        return x.shape[0], x.stride(0)
    return (x.numel() // x.shape[-1], x.shape[-1]) if x.is_contiguous() else None


def _norm_layout(x: torch.Tensor, weight: torch.Tensor, residual: torch.Tensor | None) -> tuple[int, int, int] | None:
    """(row count, ``x``'s row stride, ``residual``'s row stride) where :func:`rms_norm` takes these
    tensors, else None (see :func:`norm_takes`)."""
    if x.device.type != "cpu" or x.dtype not in NATIVE_DTYPES or weight.dtype != x.dtype or weight.dim() != 1:
        return None
    if weight.stride(0) != 1 or not x.shape[-1] == weight.shape[0] > 0:
        return None
    rows = _rows(x)
    if residual is None or rows is None:
        return None if rows is None else (rows[0], rows[1], 0)
    if residual.dtype != x.dtype or residual.shape != x.shape:
        return None
    other = _rows(residual)
    return None if other is None else (rows[0], rows[1], other[1])


def norm_takes(x: torch.Tensor, weight: torch.Tensor, residual: torch.Tensor | None = None) -> bool:
    """Whether :func:`rms_norm` takes these tensors: CPU tensors of one dtype of :data:`NATIVE_DTYPES`,
    ``weight`` dense ``[D]``, ``x`` (and ``residual``, of its shape) rows of ``D`` dense elements evenly
    strided, and the library built."""
    return _norm_layout(x, weight, residual) is not None and library() is not None


def rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """:func:`pypto_kernels.rms_norm` (``residual`` None) or :func:`pypto_kernels.add_rms_norm` of each
    row in one C pass (``csrc/norm_rope.c``): the reference's rounding steps in its order but for the
    mean of squares' summation order.

    :param x: rows of ``D`` (:func:`norm_takes`).
    :param weight: ``[D]``, of ``x``'s dtype.
    :param eps: added to the mean of squares.
    :param residual: added to ``x`` first (rounded to the dtype, as torch's add), or None.
    :return: ``(normalised, x + residual)`` (new tensors of ``x``'s shape), the second None without a residual.
    """
    lib, layout = library(), _norm_layout(x, weight, residual)
    if lib is None or layout is None:
        raise ValueError(f"the native rms_norm does not take x {tuple(x.shape)} {x.dtype} with weight {weight.dtype}")
    (n, xs, rs), d = layout, x.shape[-1]
    out = torch.empty(x.shape, dtype=x.dtype)
    summed = None if residual is None else torch.empty(x.shape, dtype=x.dtype)
    lib.pypto_rms_norm(
        x.data_ptr(), xs, None if residual is None else residual.data_ptr(), rs, weight.data_ptr(),
        NATIVE_DTYPES[x.dtype], n, d, eps, out.data_ptr(), d, None if summed is None else summed.data_ptr(), d,
        torch.get_num_threads(),
    )  # fmt: skip
    return out, summed


def sample_rows_takes(x: torch.Tensor) -> bool:
    """Whether :func:`sample_rows` takes ``x``: float32 rows ``[S, V]`` in host memory, each dense
    (evenly strided), under 2**31 columns, with the library built."""
    if x.device.type != "cpu" or x.dtype != torch.float32 or x.dim() != 2 or x.shape[1] >= 2**31:
        return False
    return (x.shape[1] <= 1 or x.stride(1) == 1) and library() is not None


def sample_rows(
    x: torch.Tensor,
    rows: torch.Tensor | None,
    temperature: torch.Tensor,
    top_k: torch.Tensor,
    top_p: torch.Tensor,
    min_p: torch.Tensor,
    uniforms: torch.Tensor,
) -> torch.Tensor:
    """Each row's sampled token in a few C passes over it (``csrc/sample.c``): the draw of
    ``pypto_serving.sampler`` (the kept tokens: top-k, then top-p over them or the whole row, then
    min-p; the token where ``uniforms[r]`` times their weight falls in their cumulative weight in id
    order), without sorting the vocabulary. The same token as the torch draw but where a rounding
    moves the uniform across a boundary; a row's token depends on that row alone, whatever the batch
    and the threads.

    :param x: ``[N, V]`` float32 logits after every edit (:func:`sample_rows_takes`).
    :param rows: ``[S]`` int64 indices of the rows of ``x`` to draw (None: every row, ``S = N``).
    :param temperature: ``[S]`` float32, each > 0; ``top_k`` ``[S]`` int64 (0, or V and more: none);
        ``top_p`` ``[S]`` float32 in (0, 1] (1: none); ``min_p`` ``[S]`` float32 in [0, 1] (0: none).
    :param uniforms: ``[S]`` float64 in [0, 1).
    :return: ``[S]`` int64 tokens (a row whose logits are NaN, +inf or all -inf, which the sampler
        reports, gets an index of its own: its first maximum's, or with top-k its best-ranked one's).
    """
    lib = library()
    if lib is None or not sample_rows_takes(x):
        raise ValueError(f"the native sample_rows does not take x {tuple(x.shape)} {x.dtype} on {x.device}")
    vocab = x.shape[1]
    picked = None if rows is None else rows.to(torch.int64).contiguous()
    if picked is not None and picked.numel() and not bool(((picked >= 0) & (picked < x.shape[0])).all()):
        raise ValueError(f"sample_rows: a row index outside x's {x.shape[0]} rows")
    count = x.shape[0] if picked is None else picked.shape[0]
    args = (
        temperature.to(torch.float32).contiguous(), top_k.to(torch.int64).contiguous(),
        top_p.to(torch.float32).contiguous(), min_p.to(torch.float32).contiguous(),
        uniforms.to(torch.float64).contiguous(),
    )  # fmt: skip
    if any(a.shape != (count,) for a in args):
        raise ValueError(f"sample_rows takes one parameter a row ({count} rows): {[tuple(a.shape) for a in args]}")
    tokens = torch.zeros(count, dtype=torch.int64)
    if count and vocab:
        stride, at = x.stride(0) if x.shape[0] > 1 else vocab, None if picked is None else picked.data_ptr()
        ptrs = [a.data_ptr() for a in args]
        threads = torch.get_num_threads()
        if lib.pypto_sample_rows(x.data_ptr(), stride, at, count, vocab, *ptrs, tokens.data_ptr(), threads):
            raise MemoryError("sample_rows: no thread's scratch could be allocated")
    return tokens


def sample_uniforms(seeds: list[int], indices: list[int]) -> torch.Tensor:
    """``pypto_serving.sampler.uniforms`` of each (seed, output index) pair, from the C function the
    native loop draws with (``csrc/sample.c``: splitmix64, bit for bit the sampler's): float64 ``[S]``."""
    lib = library()
    if lib is None:
        raise RuntimeError("the native CPU kernels are not available (see the log)")
    return torch.tensor(
        [lib.pypto_sample_uniform(s, i) for s, i in zip(seeds, indices, strict=True)], dtype=torch.float64
    )


class SampleDraw:
    """``pypto_serving.sampler.DrawKernel`` through :func:`sample_rows`: its tokens where it takes the
    logits, else None (the sampler's torch ops draw); counts the rows it drew."""

    def __init__(self) -> None:
        self.rows = 0

    def __call__(
        self,
        x: torch.Tensor,
        rows: torch.Tensor | None,
        temperature: torch.Tensor,
        top_k: torch.Tensor,
        top_p: torch.Tensor,
        min_p: torch.Tensor,
        uniforms: torch.Tensor,
    ) -> torch.Tensor | None:
        if not sample_rows_takes(x):
            return None
        tokens = sample_rows(x, rows, temperature, top_k, top_p, min_p, uniforms)
        self.rows += tokens.shape[0]
        return tokens


def _silu_layout(x: torch.Tensor) -> tuple[int, int] | None:
    """``x``'s rows (count, stride) where :func:`silu_mul` takes it (see :func:`silu_takes`), else None."""
    if x.device.type != "cpu" or x.dtype not in NATIVE_DTYPES or x.dim() == 0 or x.shape[-1] % 2:
        return None
    return _rows(x)


def silu_takes(x: torch.Tensor) -> bool:
    """Whether :func:`silu_mul` takes ``x``: a CPU tensor of a dtype of :data:`NATIVE_DTYPES`, an even
    last dimension, rows of dense elements evenly strided, the library built, and a CPU where GCC
    vectorises its loop: not an x86 one without AVX-512, where the loop (the exponential's clamps)
    stays scalar: an AVX2 build run on the Zen 4 EPYC of docs/benchmarks.md took 7x the time of torch's
    ops there (64 rows of 3,072: 620-660 against 80-100 µs)."""
    return _silu_layout(x) is not None and not avx2_without_avx512(cpu_flags()) and library() is not None


def silu_mul(x: torch.Tensor) -> torch.Tensor:
    """:func:`pypto_kernels.silu_and_mul` of each row in one C pass (``csrc/norm_rope.c``): torch's
    ``F.silu(gate) * up`` with its roundings, silu's exponential another (float32 results within 4 ulps).

    :param x: ``[..., 2 I]`` rows, the gate's ``I`` values then the up's (:func:`silu_takes`).
    :return: ``[..., I]`` of ``x``'s dtype (a new tensor).
    """
    lib, layout = library(), _silu_layout(x)
    if lib is None or layout is None:
        raise ValueError(f"the native silu_mul does not take x {tuple(x.shape)} {x.dtype}")
    (n, xs), half = layout, x.shape[-1] // 2
    out = torch.empty((*x.shape[:-1], half), dtype=x.dtype)
    if n and half:
        kind, threads = NATIVE_DTYPES[x.dtype], torch.get_num_threads()
        lib.pypto_silu_mul(x.data_ptr(), xs, kind, n, half, out.data_ptr(), half, threads)
    return out


def qk_rope_takes(
    qkv: torch.Tensor,
    head_dim: int,
    norms: tuple[torch.Tensor | None, torch.Tensor | None],
    cos: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
) -> bool:
    """Whether :func:`qk_norm_rope_write_kv` takes these tensors: CPU, ``qkv`` 2-D rows of dense
    elements and ``cos`` of its dtype (one of :data:`NATIVE_DTYPES`), the norms both given (of that
    dtype, dense) or both None, a head of at most :data:`MAX_HEAD_DIM`, caches of one dtype of
    :data:`NATIVE_DTYPES` (no FP8) with a dense head dimension, and the library built."""
    q_norm, k_norm = norms
    if (q_norm is None) != (k_norm is None):
        return False
    dense_norms = q_norm is None or all(
        w is not None and w.dtype == qkv.dtype and w.shape == (head_dim,) and w.stride(0) == 1 for w in norms
    )
    return (
        qkv.device.type == "cpu"
        and qkv.dtype in NATIVE_DTYPES
        and qkv.dim() == 2
        and qkv.stride(1) == 1
        and cos.dtype == qkv.dtype
        and cos.dim() == 2
        and cos.stride(1) == 1
        and 0 < head_dim <= MAX_HEAD_DIM
        and dense_norms
        and key_cache.dim() == value_cache.dim() == 4
        and key_cache.dtype in NATIVE_DTYPES
        and value_cache.dtype == key_cache.dtype
        and key_cache.stride(-1) == value_cache.stride(-1) == 1
        and key_cache.shape[-1] == value_cache.shape[-1] == head_dim
        and library() is not None
    )


def qk_norm_rope_write_kv(
    qkv: torch.Tensor,
    num_q_heads: int,
    num_kv_heads: int,
    head_dim: int,
    norms: tuple[torch.Tensor | None, torch.Tensor | None],
    eps: float,
    rotary: tuple[torch.Tensor, torch.Tensor],
    caches: tuple[torch.Tensor, torch.Tensor],
    slot_mapping: torch.Tensor,
) -> torch.Tensor:
    """:func:`pypto_kernels.qk_norm_rope_write_kv` in one C pass per token (``csrc/norm_rope.c``).

    :param qkv: ``[T, (Hq + 2 Hkv) D]`` (:func:`qk_rope_takes`).
    :param norms: the q and k per-head RMSNorm weights ``[D]``, or both None.
    :param rotary: cos and sin ``[T, rotary_dim]`` of ``qkv``'s dtype.
    :param caches: the key and value caches ``[blocks, block_size, Hkv, D]`` (any strides but the last).
    :param slot_mapping: ``[T]`` cache slots, every one in ``[0, blocks * block_size)``.
    :return: q ``[T, Hq, D]``, rotated, in ``qkv``'s dtype.
    :raises IndexError: a slot outside the caches (nothing is written).
    """
    lib = library()
    (cos, sin), (key_cache, value_cache) = rotary, caches
    if lib is None or not qk_rope_takes(qkv, head_dim, norms, cos, key_cache, value_cache):
        raise ValueError(f"the native qk_norm_rope_write_kv does not take qkv {tuple(qkv.shape)} {qkv.dtype}")
    t, rotary_dim = qkv.shape[0], cos.shape[-1]
    if qkv.shape[1] != (num_q_heads + 2 * num_kv_heads) * head_dim or cos.shape[0] != t:
        raise ValueError(f"qkv {tuple(qkv.shape)} and cos/sin {tuple(cos.shape)} do not match the heads")
    if sin.shape != cos.shape or sin.stride() != cos.stride():  # the C pass reads both with cos's row stride
        raise ValueError(f"sin {tuple(sin.shape)} must have cos's shape {tuple(cos.shape)} and strides")
    if rotary_dim % 2 or rotary_dim > head_dim:
        raise ValueError(f"rotary_dim {rotary_dim} must be even and <= the head dim {head_dim}")
    slots = slot_mapping.to(torch.int64).contiguous()
    q = torch.empty((t, num_q_heads, head_dim), dtype=qkv.dtype)
    q_norm, k_norm = norms
    status = lib.pypto_qk_norm_rope_write(
        qkv.data_ptr(), qkv.stride(0), NATIVE_DTYPES[qkv.dtype], t, num_q_heads, num_kv_heads, head_dim,
        None if q_norm is None else q_norm.data_ptr(), None if k_norm is None else k_norm.data_ptr(), eps,
        cos.data_ptr(), sin.data_ptr(), cos.stride(0), rotary_dim, q.data_ptr(), key_cache.data_ptr(),
        value_cache.data_ptr(), NATIVE_DTYPES[key_cache.dtype], _element_strides(key_cache),
        _element_strides(value_cache), key_cache.shape[1], key_cache.shape[0] * key_cache.shape[1], slots.data_ptr(),
        torch.get_num_threads(),
    )  # fmt: skip
    if status != 0:
        raise IndexError(f"slot_mapping holds a slot outside the caches' {key_cache.shape[0] * key_cache.shape[1]}")
    return q


def gemv_takes(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> bool:
    """Whether :func:`gemv` takes this product: CPU tensors of one dtype of :data:`NATIVE_DTYPES`, one
    row of ``x`` (dense), a 2-D ``weight`` with dense rows, no bias, and the library built."""
    return (
        x.device.type == "cpu"
        and x.dtype == weight.dtype
        and x.dtype in NATIVE_DTYPES
        and bias is None
        and weight.dim() == 2
        and weight.stride(1) == 1
        and x.numel() == x.shape[-1] == weight.shape[1] > 0
        and x.stride(-1) == 1
        and library() is not None
    )


def gemv(
    x: torch.Tensor,
    weight: torch.Tensor,
    *,
    logits: bool = False,
    maxima: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor:
    """``F.linear(x, weight)`` for one row (``csrc/gemv.c``): each output its row's products summed in
    float32 in a fixed order (another order than oneDNN's or MKL's: equal to float rounding), whatever
    the threads; a bfloat16 row's as the CPU's bfloat16 pair dot products (:func:`panel_linear`'s
    arithmetic, in another order), rounded to bfloat16 at the end, as torch's.

    :param x: one row of ``in`` values (any leading dimensions of size 1).
    :param weight: ``[out, in]`` of ``x``'s dtype, rows dense (:func:`gemv_takes`).
    :param logits: the product is an output projection's logits: returned as float32 (a bfloat16
        product's outputs rounded to bfloat16 as ever and stored widened: bitwise ``.float()`` of
        the bfloat16 result, without the two passes that make it).
    :param maxima: with ``logits``, a float32 and an int64 tensor of one element to fill with the
        row's maximum logit and its first index (its first NaN where it has one), taken as the
        outputs are written.
    :return: ``[..., out]`` in ``x``'s dtype (``logits``: float32), ``x``'s leading dimensions.
    """
    lib = library()
    if lib is None or not gemv_takes(x, weight):
        raise ValueError(f"the native gemv does not take x {tuple(x.shape)} {x.dtype} and weight {tuple(weight.shape)}")
    if maxima is not None and not _maxima_take(maxima, 1, logits, weight.shape[0]):
        raise ValueError("maxima are a contiguous float32 and int64 tensor of one element per row of a logits product")
    row = x.to(torch.float32)
    out = torch.empty((*x.shape[:-1], weight.shape[0]), dtype=torch.float32)
    ptrs = (None, None) if maxima is None else (maxima[0].data_ptr(), maxima[1].data_ptr())
    status = lib.pypto_gemv(
        weight.data_ptr(), NATIVE_DTYPES[weight.dtype], weight.stride(0), row.data_ptr(), out.data_ptr(),
        weight.shape[0], weight.shape[1], int(logits and weight.dtype == torch.bfloat16), *ptrs,
        torch.get_num_threads(),
    )  # fmt: skip
    if status != 0:
        raise MemoryError("the native gemv could not allocate its scratch")
    return out if logits else out.to(x.dtype)


def grouped_gemv_takes(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether :func:`grouped_gemv` takes this product: CPU tensors of one dtype of
    :data:`NATIVE_DTYPES`, dense ``[rows, in]`` rows, a ``[experts, out, in]`` weight with dense rows
    and experts, and the library built."""
    return (
        x.device.type == "cpu"
        and x.dtype == weight.dtype
        and x.dtype in NATIVE_DTYPES
        and x.dim() == 2
        and weight.dim() == 3
        and x.shape[1] == weight.shape[2] > 0
        and weight.stride(2) == 1
        and weight.stride(1) >= weight.shape[2]
        and x.is_contiguous()
        and library() is not None
    )


def grouped_gemv(x: torch.Tensor, weight: torch.Tensor, ends: torch.Tensor) -> torch.Tensor:
    """Rows sorted by expert times their experts' matrices (``csrc/gemv.c``): rows
    ``[ends[e - 1], ends[e])`` times ``weight[e]`` transposed, as ``F.linear`` of each segment; each
    output summed as :func:`gemv` sums it for that row alone (so it depends neither on the other rows
    of its expert nor on the threads), bfloat16 ones rounded to bfloat16 at the end, as torch's.

    :param x: ``[rows, in]``, ``rows = ends[-1]`` (:func:`grouped_gemv_takes`).
    :param weight: ``[experts, out, in]`` of ``x``'s dtype.
    :param ends: ``[experts]``, each expert's end row, non-negative and non-decreasing.
    :return: ``[rows, out]`` in ``x``'s dtype.
    """
    lib = library()
    if lib is None or not grouped_gemv_takes(x, weight):
        raise ValueError(
            f"the native grouped gemv does not take x {tuple(x.shape)} {x.dtype} and weight {tuple(weight.shape)}"
        )
    ends = ends.to(torch.int64).contiguous()
    if ends.numel() != weight.shape[0] or (ends.numel() and int(ends[-1]) != x.shape[0]):
        raise ValueError(f"ends {ends.tolist()} do not end at the {x.shape[0]} rows of {weight.shape[0]} experts")
    if ends.numel() and (int(ends[0]) < 0 or bool((ends.diff() < 0).any())):  # rows the C would read outside x
        raise ValueError(f"ends {ends.tolist()} are not non-decreasing from 0")
    rows = x.to(torch.float32)
    out = torch.empty((x.shape[0], weight.shape[1]), dtype=torch.float32)
    status = lib.pypto_grouped_gemv(
        weight.data_ptr(), NATIVE_DTYPES[weight.dtype], weight.stride(0), weight.stride(1), rows.data_ptr(),
        out.data_ptr(), ends.data_ptr(), weight.shape[0], weight.shape[1], weight.shape[2],
        int(weight.dtype == torch.bfloat16), torch.get_num_threads(),
    )  # fmt: skip
    if status != 0:
        raise MemoryError("the native grouped gemv could not allocate its scratch")
    return out.to(x.dtype)


#: Routes per expert (a call's routes over its experts) up to which the native grouped products run the
#: routed experts (:func:`grouped_gemv`, :func:`moe_block`), by the stored dtype: beyond them each
#: expert's rows are enough for torch's grouped GEMM to win (docs/benchmarks.md, "Routed experts read
#: once for their rows").
MOE_ROUTES_PER_EXPERT = {torch.bfloat16: 8, torch.float32: 32}


@dataclass(frozen=True, slots=True)
class PackedExperts:
    """Every expert's ``[out, in]`` matrix as :func:`pack_panels` lays it out, in one tensor
    ``[experts, *panels]`` (:func:`pack_experts`): what :func:`grouped_panel_linear` and
    :func:`moe_block` multiply at the FLOP peak with a few rows an expert.

    :param panels: ``[experts, ceil(out / 64), in or in / 2, 64 or 128]``, contiguous.
    :param out_features: each matrix's outputs.
    """

    panels: torch.Tensor
    out_features: int

    @property
    def shape(self) -> tuple[int, int, int]:
        """``(experts, out, in)``, the plain matrices' shape."""
        return self.panels.shape[0], self.out_features, _panel_inputs(self.panels[0])

    @property
    def dtype(self) -> torch.dtype:
        return self.panels.dtype

    def plain(self) -> torch.Tensor:
        """The ``[experts, out, in]`` matrices (a new tensor)."""
        return torch.stack([unpack_panels(p, self.out_features) for p in self.panels])


def pack_experts(weight: torch.Tensor) -> PackedExperts:
    """``[experts, out, in]`` float32 or bfloat16 CPU matrices as :class:`PackedExperts`: each expert's
    :func:`pack_panels`, all of them in one copy (outputs padded to whole panels first where ``out`` is
    not a multiple of 64)."""
    if weight.dim() != 3 or weight.shape[0] == 0:
        raise ValueError(f"pack_experts takes [experts, out, in] matrices, got {tuple(weight.shape)}")
    pack_panels(weight[0, :1])  # the dtype, device and width checks, on one row
    experts, out, inner = weight.shape
    count = -(-out // PANEL_WIDTH)
    if count * PANEL_WIDTH != out:
        padded = torch.zeros(experts, count * PANEL_WIDTH, inner, dtype=weight.dtype)
        padded[:, :out] = weight
        weight = padded
    if weight.dtype == torch.float32:
        panels = weight.reshape(experts, count, PANEL_WIDTH, inner).transpose(2, 3).contiguous()
    else:
        pairs = weight.reshape(experts, count, PANEL_WIDTH, inner // 2, 2).permute(0, 1, 3, 2, 4)
        panels = pairs.reshape(experts, count, inner // 2, 2 * PANEL_WIDTH).contiguous()
    return PackedExperts(panels, out)


def _experts_take(x: torch.Tensor, gate_up: torch.Tensor | PackedExperts, down: torch.Tensor | PackedExperts) -> bool:
    """Both expert stacks plain with dense rows (``x`` as :func:`grouped_gemv_takes` wants), or both
    :class:`PackedExperts` of ``x``'s dtype."""
    if isinstance(gate_up, PackedExperts) and isinstance(down, PackedExperts):
        return (
            gate_up.dtype == down.dtype == x.dtype
            and x.dtype in NATIVE_DTYPES
            and x.dim() == 2
            and x.is_contiguous()
            and x.device.type == "cpu"
            and gate_up.panels.is_contiguous()
            and down.panels.is_contiguous()
            and library() is not None
        )
    if isinstance(gate_up, PackedExperts) or isinstance(down, PackedExperts):
        return False
    return (
        grouped_gemv_takes(x, gate_up)
        and down.dim() == 3
        and down.stride(2) == 1
        and down.stride(1) == down.shape[2]
        and gate_up.stride(1) == gate_up.shape[2]
    )


def moe_block_takes(
    x: torch.Tensor, router: torch.Tensor, gate_up: torch.Tensor | PackedExperts, down: torch.Tensor | PackedExperts
) -> bool:
    """Whether :func:`moe_block` takes these operands: CPU tensors of one dtype of
    :data:`NATIVE_DTYPES`, dense ``[rows, hidden]`` rows, a dense ``[experts, hidden]`` router, and
    ``[experts, 2 inter, hidden]`` and ``[experts, hidden, inter]`` experts, plain with dense rows or
    both :class:`PackedExperts` (``hidden`` and ``inter`` even in bfloat16), and the library built."""
    experts, hidden = router.shape if router.dim() == 2 else (0, 0)
    e1, two_inter, h1 = gate_up.shape
    e2, h2, inter = down.shape
    return (
        _experts_take(x, gate_up, down)
        and router.dtype == x.dtype
        and router.is_contiguous()
        and 0 < experts == e1 == e2
        and hidden == x.shape[1] == h1 == h2
        and two_inter == 2 * inter
    )


def expert_operands(weight: torch.Tensor | PackedExperts) -> tuple[int, int, bool]:
    """``weight``'s address, the step from one expert to the next (plain: elements; panels: bytes) and
    whether it is panels, as ``csrc/moe.c`` takes an expert stack."""
    if isinstance(weight, PackedExperts):
        return weight.panels.data_ptr(), weight.panels.stride(0) * weight.panels.element_size(), True
    return weight.data_ptr(), weight.stride(0), False


def moe_block(
    x: torch.Tensor,
    router: torch.Tensor,
    gate_up: torch.Tensor | PackedExperts,
    down: torch.Tensor | PackedExperts,
    top_k: int,
    norm_topk: bool,
) -> torch.Tensor:
    """A mixture of experts' routed block for each row of ``x`` (``csrc/moe.c``): softmax routing over
    ``x @ router.T`` (rounded to ``x``'s dtype), the ``top_k`` most probable experts (ties to the lower
    expert), their probabilities divided by their sum where ``norm_topk``, and the sum over those experts,
    in expert order, of ``weight * down_e(silu(gate) * up)`` (``[gate up] = gate_up_e x``), each product
    and partial sum rounded to the dtype. A row's result depends only on that row.

    :param x: ``[rows, hidden]`` (:func:`moe_block_takes`); ``router`` ``[experts, hidden]``.
    :param gate_up: ``[experts, 2 inter, hidden]``; ``down`` ``[experts, hidden, inter]``: plain (their
        products :func:`grouped_gemv`'s) or both :class:`PackedExperts` (:func:`grouped_panel_linear`'s).
    :return: ``[rows, hidden]`` in ``x``'s dtype.
    """
    lib = library()
    if lib is None or not moe_block_takes(x, router, gate_up, down):
        raise ValueError(
            f"the native MoE block does not take x {tuple(x.shape)} {x.dtype}, router {tuple(router.shape)} "
            f"{router.dtype}, experts {tuple(gate_up.shape)} / {tuple(down.shape)} {gate_up.dtype}"
        )
    experts, inter = router.shape[0], down.shape[2]
    if not 0 < top_k <= experts:
        raise ValueError(f"top_k {top_k} is not in 1..{experts}")
    rows, hidden = x.shape
    scratch = torch.empty(lib.pypto_moe_scratch_bytes(rows, hidden, experts, top_k, inter), dtype=torch.uint8)
    out = torch.empty_like(x)
    (g, gs, panels), (d, ds, _) = expert_operands(gate_up), expert_operands(down)
    status = lib.pypto_moe_block(
        NATIVE_DTYPES[x.dtype], x.data_ptr(), x.stride(0), router.data_ptr(), g, gs, d, ds, int(panels), rows, hidden,
        experts, top_k, inter, int(norm_topk), out.data_ptr(), out.stride(0), scratch.data_ptr(),
        torch.get_num_threads(),
    )  # fmt: skip
    if status != 0:
        raise MemoryError("the native MoE block's products could not allocate their scratch")
    return out


def grouped_panel_linear(x: torch.Tensor, experts: PackedExperts, ends: torch.Tensor) -> torch.Tensor:
    """Rows sorted by expert times their experts' panels (``csrc/panel_gemm.c``): rows
    ``[ends[e - 1], ends[e])`` times expert ``e``'s matrix transposed, each output
    :func:`panel_linear`'s for its row alone.

    :param x: ``[rows, in]`` dense, of the experts' dtype, ``rows = ends[-1]``.
    :param ends: ``[experts]``, each expert's end row, non-negative and non-decreasing.
    :return: ``[rows, out]`` in ``x``'s dtype.
    """
    lib = library()
    count, out_features, inputs = experts.shape
    if lib is None or x.dtype != experts.dtype or x.dim() != 2 or x.shape[1] != inputs or not x.is_contiguous():
        raise ValueError(f"the grouped panel product does not take x {tuple(x.shape)} {x.dtype}")
    ends = ends.to(torch.int64).contiguous()
    if ends.numel() != count or (count and int(ends[-1]) != x.shape[0]):
        raise ValueError(f"ends {ends.tolist()} do not end at the {x.shape[0]} rows of {count} experts")
    if count and (int(ends[0]) < 0 or bool((ends.diff() < 0).any())):
        raise ValueError(f"ends {ends.tolist()} are not non-decreasing from 0")
    out = torch.empty((x.shape[0], out_features), dtype=x.dtype)
    ptr, step, _ = expert_operands(experts)
    status = lib.pypto_grouped_panel_gemm(
        NATIVE_DTYPES[x.dtype], x.data_ptr(), inputs, ptr, step, out.data_ptr(), out_features, ends.data_ptr(), count,
        out_features, inputs, torch.get_num_threads(),
    )  # fmt: skip
    if status != 0:
        raise MemoryError("the grouped panel product could not allocate its item table")
    return out


#: Outputs per panel of :func:`pack_panels` (four 16-float vectors).
PANEL_WIDTH = 64


def pack_panels(weight: torch.Tensor) -> torch.Tensor:
    """A float32 or bfloat16 ``[out, in]`` matrix as :func:`panel_linear` reads it, 64 outputs side by
    side per panel, the outputs past ``out`` zero (at most 63 extra): float32 as ``[ceil(out / 64),
    in, 64]`` (panel ``p`` row ``i`` the weights of outputs ``64 p .. 64 p + 63`` for input ``i``);
    bfloat16 as ``[ceil(out / 64), in / 2, 128]`` (row ``i`` those outputs' weights for inputs ``2 i``
    and ``2 i + 1``, the two side by side for each output: the operand layout of AVX512-BF16's pair dot
    product), ``in`` even."""
    if weight.dim() != 2 or weight.dtype not in NATIVE_DTYPES or weight.device.type != "cpu":
        raise ValueError(
            f"pack_panels takes a 2-D float32 or bfloat16 CPU matrix, got {tuple(weight.shape)} {weight.dtype}"
        )
    out, inner = weight.shape
    if weight.dtype == torch.bfloat16 and inner % 2:
        raise ValueError(f"bfloat16 panels pair the inputs: {inner} inputs is odd")
    count = -(-out // PANEL_WIDTH)
    padded = torch.zeros(count * PANEL_WIDTH, inner, dtype=weight.dtype)
    padded[:out] = weight
    if weight.dtype == torch.float32:
        return padded.view(count, PANEL_WIDTH, inner).transpose(1, 2).contiguous()
    pairs = padded.view(count, PANEL_WIDTH, inner // 2, 2).permute(0, 2, 1, 3)
    return pairs.reshape(count, inner // 2, 2 * PANEL_WIDTH).contiguous()


def _panel_inputs(panels: torch.Tensor) -> int:
    """The inputs of the matrix :func:`pack_panels` made ``panels`` from."""
    return panels.shape[1] * (2 if panels.dtype == torch.bfloat16 else 1)


def unpack_panels(panels: torch.Tensor, out_features: int) -> torch.Tensor:
    """The ``[out_features, in]`` matrix :func:`pack_panels` made ``panels`` from (a new tensor)."""
    count, rows, _ = panels.shape
    if panels.dtype == torch.bfloat16:
        pairs = panels.view(count, rows, PANEL_WIDTH, 2).permute(0, 2, 1, 3)
        return pairs.reshape(count * PANEL_WIDTH, 2 * rows)[:out_features].contiguous()
    return panels.transpose(1, 2).reshape(count * PANEL_WIDTH, rows)[:out_features].contiguous()


def panel_takes(x: torch.Tensor, panels: torch.Tensor, bias: torch.Tensor | None = None) -> bool:
    """Whether :func:`panel_linear` takes this product: CPU tensors of one dtype of
    :data:`NATIVE_DTYPES` (``x``, the panels, a dense bias if any), ``x``'s last dimension the panels'
    inputs, and the library built."""
    return (
        x.device.type == "cpu"
        and x.dtype == panels.dtype
        and x.dtype in NATIVE_DTYPES
        and x.dim() >= 1
        and panels.dim() == 3
        and x.shape[-1] == _panel_inputs(panels)
        and (bias is None or (bias.dtype == x.dtype and bias.dim() == 1 and bias.is_contiguous()))
        and library() is not None
    )


def panel_linear(
    x: torch.Tensor,
    panels: torch.Tensor,
    out_features: int,
    bias: torch.Tensor | None = None,
    *,
    logits: bool = False,
    maxima: tuple[torch.Tensor, torch.Tensor] | None = None,
    store_logits: bool = True,
) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` for the ``[out_features, in]`` matrix packed by :func:`pack_panels`
    (``csrc/panel_gemm.c``), so that a row's result is bitwise the same in any batch and on any number
    of threads (another order than oneDNN's or MKL's: equal to float rounding). float32: each output
    one chain of fused multiply-adds over the inputs in order, then the bias. bfloat16: one chain of
    pair dot products (AVX512-BF16's, each pair's two products added to the float32 sum) over the
    input pairs in order, plus the bias, rounded once to bfloat16 (as torch's).

    :param x: ``[..., in]`` rows of the panels' dtype.
    :param panels: :func:`pack_panels`'s result for the matrix.
    :param out_features: the matrix's outputs (the panels are padded to a multiple of 64).
    :param bias: ``[out_features]`` of the same dtype, or None.
    :param logits: the product is an output projection's logits: returned as float32 (a bfloat16
        product's outputs rounded to bfloat16 as ever, stored widened: bitwise ``.float()`` of the
        bfloat16 result, without the pass over it that makes) and stored past the caches (read once,
        after the whole product; ``csrc/panel_gemm.c``).
    :param maxima: with ``logits``, a float32 and an int64 tensor of one element per row to fill with
        each row's maximum logit and its first index (its first NaN where it has one: ``amax`` and
        ``argmax`` of the result), taken as the logits are computed.
    :param store_logits: False (with ``maxima``): only the maxima are taken, the logits are not
        written anywhere, and the result is ``[..., 0]`` (a greedy step that reads nothing else).
    :return: ``[..., out_features]`` of ``x``'s dtype (``logits``: float32); ``[..., 0]`` float32
        where the logits are not stored.
    """
    lib = library()
    if lib is None or not panel_takes(x, panels, bias) or (bias is not None and bias.shape[0] != out_features):
        raise ValueError(
            f"the native panel product does not take x {tuple(x.shape)} {x.dtype} and panels "
            f"{tuple(panels.shape)} {panels.dtype}"
        )
    padded = panels.shape[0] * PANEL_WIDTH
    if not panels.is_contiguous() or not 0 <= out_features <= padded < out_features + PANEL_WIDTH:
        raise ValueError(f"panels {tuple(panels.shape)} are not pack_panels' layout of {out_features} outputs")
    rows = x.reshape(-1, x.shape[-1])
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    if not store_logits and maxima is None:
        raise ValueError("a product whose logits are not stored takes their maxima")
    width = out_features if store_logits else 0
    out = torch.empty((rows.shape[0], width), dtype=torch.float32 if logits else x.dtype)
    peak, index = maxima if maxima is not None else (None, None)
    if maxima is not None and not _maxima_take(maxima, rows.shape[0], logits, out_features):
        raise ValueError("maxima are a contiguous float32 and int64 tensor of one element per row of a logits product")
    if rows.shape[0] and out_features:
        common = (NATIVE_DTYPES[x.dtype], rows.data_ptr(), rows.stride(0), panels.data_ptr())
        where = out.data_ptr() if store_logits else None
        args = (None if bias is None else bias.data_ptr(), where, out_features, rows.shape[0], out_features)
        if logits:
            ptrs = (None, None) if peak is None or index is None else (peak.data_ptr(), index.data_ptr())
            lib.pypto_panel_gemm_logits(*common, *args, rows.shape[1], *ptrs, torch.get_num_threads())
            if index is not None and bool((index < 0).any()):
                raise MemoryError("the native panel product could not allocate its row maxima's scratch")
        else:
            lib.pypto_panel_gemm(*common, *args, rows.shape[1], torch.get_num_threads())
    return out.reshape(*x.shape[:-1], width)


def _maxima_take(maxima: tuple[torch.Tensor, torch.Tensor], rows: int, logits: bool, out_features: int) -> bool:
    peak, index = maxima
    return (
        logits
        and out_features > 0
        and peak.dtype == torch.float32
        and index.dtype == torch.int64
        and peak.is_contiguous()
        and index.is_contiguous()
        and peak.numel() == index.numel() == rows
    )
