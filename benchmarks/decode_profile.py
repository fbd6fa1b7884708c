"""Where a decode step's time goes: torch.profiler over the Qwen executor's forward.

Loads a Qwen checkpoint (e.g. ``benchmarks/make_models.py``'s ``qwen3-0.6b``) into the Qwen
executor, prefills N requests to about C tokens of context each, then profiles decode steps of all N
(one token each) and prints the wall time per step, the share of the time inside
``paged_attention``, and the operators with the most self CPU time.

    python benchmarks/decode_profile.py --model /work/models/qwen3-0.6b --requests 64 --context 260

``--device cuda`` runs it on a GPU (the batches copied there, each step timed to the device's end,
and the profile's table by device time as well).

``--cpu-linear reference auto`` loads one executor per ``executor_options["cpu_linear"]`` value and
alternates their decode steps (before / after on a shared, noisy machine; ``auto-avx512`` is ``auto``
as an Intel AVX-512 CPU's packing rule chooses: float32 plain); ``--kv-layout auto token_major`` does the
same for the CPU's head-major KV caches against token-major ones, and ``--attention native torch`` for
the native C decode attention against the torch paths (with a bfloat16 model, a bfloat16 cache
against the float32 one the torch paths keep); ``--heads`` times the output projection's
plain paths and the native one-row GEMV against oneDNN's packed copy; ``--glue`` the native RMSNorm
and q/k passes against their torch ops; ``--panels`` every projection through the native column
panels against oneDNN's packed copies; ``--linears`` instead
times :func:`pypto_kernels.linear`'s CPU fast path against its reference per shape and row count (the
output projection stored ``[in, out]``, and the Qwen3-0.6B shape's decoder projections multiplied
transposed too, for comparison), interleaved, best and median of ``--reps``:

    python benchmarks/decode_profile.py --linears --threads 2 --reps 15
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import platform
import statistics
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # for tests.plugins.qwen.qwen_fixtures

import pypto_kernels as K
from pypto_kernels.backends import cpu
from tests.device_helpers import batch_on
from tests.plugins.qwen.qwen_fixtures import PagedBatchBuilder, qwen_settings

#: name -> (weight [out, in] as stored: "in_out" for the output projection's [in, out] storage).
LINEAR_SHAPES: dict[str, tuple[int, int, str]] = {
    "head 256 x 151936 (small)": (151936, 256, "in_out"),
    "head 1024 x 151936 (0.6B)": (151936, 1024, "in_out"),
    "qkv 1024 -> 4096 (0.6B)": (4096, 1024, "out_in"),
    "gate_up 1024 -> 6144 (0.6B)": (6144, 1024, "out_in"),
    "o 2048 -> 1024 (0.6B)": (1024, 2048, "out_in"),
    "down 3072 -> 1024 (0.6B)": (1024, 3072, "out_in"),
    "qkv 256 -> 512 (small)": (512, 256, "out_in"),
    "o 256 -> 256 (small)": (256, 256, "out_in"),
    "gate_up 256 -> 1536 (small)": (1536, 256, "out_in"),
    "down 768 -> 256 (small)": (256, 768, "out_in"),
}


def cpu_model() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines() if Path("/proc/cpuinfo").exists() else []:
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.processor() or "unknown CPU"


def _interleaved(paths: dict[str, Callable[[], torch.Tensor]], reps: int) -> tuple[dict[str, float], dict[str, float]]:
    """Best and median ms of each path over ``reps`` rounds, the paths interleaved within a round."""
    times: dict[str, list[float]] = {k: [] for k in paths}
    for _ in range(reps):
        for key, fn in paths.items():
            t0 = time.perf_counter()
            fn()
            times[key].append((time.perf_counter() - t0) * 1e3)
    return {k: min(v) for k, v in times.items()}, {k: statistics.median(v) for k, v in times.items()}


def time_linears(rows: list[int], reps: int) -> None:
    """Reference (``F.linear``, i.e. ``x @ W_t`` for an ``[in, out]`` weight) against the chunked
    transposed product, per shape and row count, the two interleaved."""
    gen = torch.Generator().manual_seed(0)
    print(f"{cpu_model()}, torch {torch.__version__}, {torch.get_num_threads()} thread(s), float32")
    print("| weight | rows | reference ms, best / median | transposed ms, best / median | speed-up, best | bitwise |")
    print("|---|---:|---:|---:|---:|---|")
    for name, (out_f, in_f, layout) in LINEAR_SHAPES.items():
        stored = torch.randn((in_f, out_f) if layout == "in_out" else (out_f, in_f), generator=gen) / in_f**0.5
        weight = stored.t() if layout == "in_out" else stored
        for n in rows:
            x = torch.randn(n, in_f, generator=gen)
            paths: dict[str, Callable[[], torch.Tensor]] = {
                "ref": lambda x=x, w=weight: F.linear(x, w),
                "fast": lambda x=x, w=weight: cpu.transposed_linear(x, w),
            }
            best, med = _interleaved(paths, reps)
            same = torch.equal(paths["ref"](), paths["fast"]())
            print(
                f"| {name} | {n} | {best['ref']:.2f} / {med['ref']:.2f} | {best['fast']:.2f} / {med['fast']:.2f} "
                f"| {best['ref'] / best['fast']:.2f}x | {'yes' if same else 'no'} |",
                flush=True,
            )


def _alternating(fn: Callable[[Any], torch.Tensor], operands: list[Any]) -> Callable[[], torch.Tensor]:
    """``fn`` over ``operands`` in turn, one per call (cold: each operand evicted by the others)."""
    turn = iter(range(1 << 62))
    return lambda: fn(operands[next(turn) % len(operands)])


def _onednn(x: torch.Tensor, packed: Any) -> torch.Tensor:
    out: torch.Tensor = torch.ops.mkldnn._linear_pointwise(x, packed.packed, None, "none", [], "")
    return out


def time_heads(rows: list[int], reps: int) -> None:
    """The 151,936-row output projection as the Qwen executor keeps it: its plain paths over the
    ``[in, out]`` matrix (``F.linear`` below 16 rows, the chunked transposed product from there) and,
    at one row, the native GEMV over the ``[vocab, hidden]`` matrix (a tied head where the native
    kernels are built), against oneDNN's packed copy, per dtype, hidden size and row count,
    interleaved, best and median of ``reps``; cold (two matrices alternated, over 32 MiB each)."""
    gen = torch.Generator().manual_seed(0)
    print(f"{cpu_model()}, torch {torch.__version__}, {torch.get_num_threads()} thread(s)")
    print(
        "| dtype | hidden | rows | plain ms, best / median | native GEMV ms, best / median | oneDNN copy ms, "
        "best / median | oneDNN / native, median |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|")
    for dtype in (torch.float32, torch.bfloat16):
        for hidden in (256, 1024):
            stored = [(torch.randn(hidden, 151936, generator=gen) / hidden**0.5).to(dtype) for _ in range(2)]
            dense = [w.t().contiguous() for w in stored]
            packed = [K.pack_linear(w.t(), 64, library="onednn", min_rows=2) for w in stored]
            for n in rows:
                x = torch.randn(n, hidden, generator=gen).to(dtype)
                paths: dict[str, Callable[[], torch.Tensor]] = {
                    "plain": _alternating(functools.partial(lambda x, w: K.linear(x, w.t()), x), stored),
                    "packed": _alternating(functools.partial(_onednn, x), packed),
                }
                if n == 1 and K.native.gemv_takes(x, dense[0]):
                    paths["native"] = _alternating(functools.partial(K.native.gemv, x), dense)
                best, med = _interleaved(paths, reps)
                gemv = f"{best['native']:.2f} / {med['native']:.2f}" if "native" in paths else "-"
                ratio = f"{med['packed'] / med['native']:.2f}x" if "native" in paths else "-"
                print(
                    f"| {str(dtype).removeprefix('torch.')} | {hidden} | {n} | {best['plain']:.2f} / "
                    f"{med['plain']:.2f} | {gemv} | {best['packed']:.2f} / {med['packed']:.2f} | {ratio} |",
                    flush=True,
                )


def time_panels(rows: list[int], reps: int, dtype: torch.dtype) -> None:
    """Every Qwen-shaped projection in ``dtype`` (:data:`LINEAR_SHAPES`, the output projections included)
    through the native column panels (:func:`pypto_kernels.native.panel_linear`) against oneDNN's
    packed copy, per row count, interleaved, best and median of ``reps``; cold: two copies of each
    matrix alternated (the weights of a decode step do not stay cached from one step to the next)."""
    gen = torch.Generator().manual_seed(0)
    print(f"{cpu_model()}, torch {torch.__version__}, {torch.get_num_threads()} thread(s), {dtype}")
    print("| weight | rows | oneDNN ms, best / median | panels ms, best / median | oneDNN / panels, median |")
    print("|---|---:|---:|---:|---:|")
    for name, (out_f, in_f, _) in LINEAR_SHAPES.items():
        plain = [(torch.randn(out_f, in_f, generator=gen) / in_f**0.5).to(dtype) for _ in range(2)]
        onednn = [K.pack_linear(w, 64, library="onednn") for w in plain]
        panels = [K.pack_linear(w, 64, library="panels") for w in plain]
        del plain
        for n in rows:
            x = torch.randn(n, in_f, generator=gen).to(dtype)
            paths: dict[str, Callable[[], torch.Tensor]] = {
                "onednn": _alternating(functools.partial(_onednn, x), onednn),
                "panels": _alternating(functools.partial(K.linear, x), panels),
            }
            best, med = _interleaved(paths, reps)
            print(
                f"| {name} | {n} | {best['onednn']:.3f} / {med['onednn']:.3f} | {best['panels']:.3f} / "
                f"{med['panels']:.3f} | {med['onednn'] / med['panels']:.2f}x |",
                flush=True,
            )


def _hundred(fn: Callable[..., Any], *args: Any) -> Callable[[], Any]:
    return lambda: [fn(*args) for _ in range(100)]


def time_glue(reps: int) -> None:
    """The element-wise passes between a decoder layer's products: the native C passes
    (:mod:`pypto_kernels.native`) against their torch references, per shape and row count,
    interleaved, best and median microseconds of ``reps`` rounds of 100 calls."""
    from pypto_kernels.attention import qk_norm_rope_write_kv
    from pypto_kernels.norm import rms_norm

    def torch_add_rms_norm(x: torch.Tensor, res: torch.Tensor, w: torch.Tensor, eps: float) -> Any:
        summed = x + res  # the reference's own norm call would dispatch to the native pass
        return rms_norm.reference(summed, w, eps), summed  # type: ignore[attr-defined]

    gen = torch.Generator().manual_seed(0)
    print(f"{cpu_model()}, torch {torch.__version__}, {torch.get_num_threads()} thread(s), float32")
    print("| pass | shape | rows | torch ops µs, best / median | native µs, best / median | speed-up, median |")
    print("|---|---|---:|---:|---:|---:|")
    for shape, hidden, (hq, hkv, d) in (("small", 256, (4, 2, 64)), ("Qwen3-0.6B", 1024, (16, 8, 128))):
        for n in (1, 64):
            norm = (torch.randn(n, hidden, generator=gen), torch.randn(n, hidden, generator=gen), torch.randn(hidden))
            inv_freq, scaling = K.rope_inv_freq(d, 1e6, None, 4096)
            rotary = K.rope_cos_sin(torch.arange(n) + 100, inv_freq, scaling, torch.float32)
            caches = tuple(torch.zeros(256, hkv, 16, d).transpose(1, 2) for _ in range(2))
            qkv = torch.randn(n, (hq + 2 * hkv) * d, generator=gen)
            qk = (qkv, hq, hkv, d, (torch.randn(d), torch.randn(d)), 1e-6, rotary, caches, torch.arange(n) * 3)
            cases = {
                "add + RMSNorm": (torch_add_rms_norm, K.add_rms_norm, (*norm, 1e-6)),
                "q/k norms, rotation, K/V write": (qk_norm_rope_write_kv.reference, K.qk_norm_rope_write_kv, qk),  # type: ignore[attr-defined]
            }
            for name, (reference, fast, args) in cases.items():
                best, med = _interleaved({"ref": _hundred(reference, *args), "fast": _hundred(fast, *args)}, reps)
                print(
                    f"| {name} | {shape} | {n} | {best['ref'] * 10:.1f} / {med['ref'] * 10:.1f} | "
                    f"{best['fast'] * 10:.1f} / {med['fast'] * 10:.1f} | {med['ref'] / med['fast']:.2f}x |",
                    flush=True,
                )


def _prepared(args: argparse.Namespace, run: str) -> tuple[Any, PagedBatchBuilder, list[str]]:
    """An executor with ``args.requests`` requests prefilled to ``args.context`` tokens, for ``run``
    = ``cpu_linear[/token_major]``. ``cpu_linear = "auto-avx512"`` is ``auto`` as an Intel AVX-512
    CPU's packing rule chooses (float32 plain); ``/token_major`` swaps the executor's KV caches for
    contiguous (token-major) ones before the prefill, as they were before the CPU's head-major layout."""
    import pypto_kernels.device as device
    from pypto_serving_qwen.executor import QwenExecutor

    cpu_linear, layout, attention = [*run.split("/"), "auto", "native"][:3]
    block = 16
    blocks = args.requests * (-(-(args.context + args.steps * 2 + 2) // block)) + 8
    option = "auto" if cpu_linear == "auto-avx512" else cpu_linear
    options = {"cpu_linear": option}
    settings = qwen_settings(
        args.model, block_size=block, dtype=args.dtype, executor_options=options, device=args.device
    )
    ex = QwenExecutor(settings)
    real_flags, real_vendor = device.cpu_flags, device.cpu_vendor
    if cpu_linear == "auto-avx512":
        device.cpu_flags = lambda: real_flags() | {"avx512f"}  # type: ignore[assignment]
        device.cpu_vendor = lambda: "GenuineIntel"  # type: ignore[assignment]
    try:
        with _kernels(attention):
            ex.load()
            ex.init_kv_cache({"kv": blocks})
    finally:
        device.cpu_flags, device.cpu_vendor = real_flags, real_vendor  # type: ignore[assignment]
    if layout == "token_major":
        ex.kv_caches = [tuple(torch.empty(t.shape, dtype=t.dtype) for t in pair) for pair in ex.kv_caches]
    builder = PagedBatchBuilder(block, blocks)
    gen = torch.Generator().manual_seed(0)
    ids = {f"r{i}": torch.randint(10, 1000, (args.context,), generator=gen).tolist() for i in range(args.requests)}
    for rid, prompt in ids.items():  # one prefill per request, so no step is larger than one prompt
        with _kernels(attention):
            ex.execute(_on(args.device, builder.step([(rid, prompt)], all_logits=False)))
    return ex, builder, list(ids)


def _on(device: str, batch: Any) -> Any:
    """``batch``'s tensors on ``device`` (the host lists stay)."""
    return batch if device == "cpu" else batch_on(batch, device)


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


@contextlib.contextmanager
def _kernels(attention: str) -> Iterator[None]:
    """``attention = "torch"``: the native CPU kernels off meanwhile (the torch paths run)."""
    real = K.native.library
    if attention == "torch":
        K.native.library = lambda: None  # type: ignore[assignment]
    try:
        yield
    finally:
        K.native.library = real  # type: ignore[assignment]


def profile_steps(args: argparse.Namespace) -> None:
    if "native" in args.attention and K.native.library() is None:
        raise SystemExit("--attention native: the native CPU kernels are not built here (no C compiler; see the log)")
    choices = [f"{c}/{layout}/{a}" for c in args.cpu_linear for layout in args.kv_layout for a in args.attention]
    runs = {choice: _prepared(args, choice) for choice in choices}
    attention = [0.0]
    inner = K.paged_attention

    def timed(*a: object, **kw: object) -> torch.Tensor:
        t0 = time.perf_counter()
        out = inner(*a, **kw)
        attention[0] += time.perf_counter() - t0
        return out

    K.paged_attention = timed  # type: ignore[assignment]
    walls: dict[str, list[tuple[float, float]]] = {choice: [] for choice in runs}
    for _ in range(args.steps):
        for choice, (ex, builder, ids) in runs.items():  # interleaved: the neighbours' load hits both
            batch = _on(args.device, builder.step([(rid, [7]) for rid in ids], all_logits=False))
            attention[0] = 0.0
            with _kernels(choice.split("/")[2]):
                _sync(args.device)
                t0 = time.perf_counter()
                ex.execute(batch)
                _sync(args.device)
                walls[choice].append((time.perf_counter() - t0, attention[0]))
    K.paged_attention = inner  # type: ignore[assignment]
    threads = torch.get_num_threads()
    print(f"{cpu_model()}; {args.requests} decodes at ~{args.context} tokens of context, {threads} thread(s)")
    for choice, steps in walls.items():
        wall = statistics.median(w for w, _ in steps)
        att = statistics.median(a for _, a in steps)
        best = min(w for w, _ in steps)
        print(
            f"cpu_linear/kv-layout/attention={choice}: decode step {wall * 1e3:.1f} ms median of {args.steps} "
            f"(best {best * 1e3:.1f}); "
            f"paged_attention {att / wall:.0%} of it"
        )
    ex, builder, ids = runs[choices[-1]]
    batch = _on(args.device, builder.step([(rid, [7]) for rid in ids], all_logits=False))
    activities = [torch.profiler.ProfilerActivity.CPU]
    if args.device.startswith("cuda"):
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    with (
        _kernels(choices[-1].split("/")[2]),
        torch.profiler.profile(activities=activities, record_shapes=args.shapes) as prof,
    ):
        ex.execute(batch)
        _sync(args.device)
    print(f"profile of one step, cpu_linear={choices[-1]}:")
    table = prof.key_averages(group_by_input_shape=args.shapes)
    print(table.table(sort_by="self_cpu_time_total", row_limit=24 if args.shapes else 12))
    if args.device.startswith("cuda"):
        print(table.table(sort_by="self_device_time_total", row_limit=12))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", type=Path)
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--context", type=int, default=260)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--device", default="cpu", help="where the executor runs: cpu, cuda, cuda:N (default: cpu)")
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    ap.add_argument("--dtype", default="float32", choices=["auto", "float32", "bfloat16"], help="the executors' dtype")
    ap.add_argument(
        "--cpu-linear",
        nargs="+",
        default=["auto"],
        choices=["auto", "auto-avx512", "reference", "mkl", "onednn", "panels"],
        help="executor_options cpu_linear per executor, their steps alternated",
    )
    ap.add_argument(
        "--kv-layout",
        nargs="+",
        default=["auto"],
        choices=["auto", "token_major"],
        help="KV cache layout per executor (auto: the executor's own, head-major for float32 on the CPU; "
        "token_major: contiguous caches swapped in), their steps alternated",
    )
    ap.add_argument(
        "--attention",
        nargs="+",
        default=["native"],
        choices=["native", "torch"],
        help="decode attention per executor (native: the C kernel where built; torch: the torch paths), "
        "their steps alternated",
    )
    ap.add_argument("--shapes", action="store_true", help="the profile's table by input shapes")
    ap.add_argument("--linears", action="store_true", help="time pypto_kernels.linear's CPU paths instead")
    ap.add_argument("--heads", action="store_true", help="time the output projection's CPU paths instead")
    ap.add_argument(
        "--panels", action="store_true", help="time the native column panels against oneDNN's packed copies instead"
    )
    ap.add_argument(
        "--glue", action="store_true", help="time the native norm and q/k passes against their torch ops instead"
    )
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 4, 8, 16, 32, 64])
    ap.add_argument("--reps", type=int, default=9)
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.glue:
        time_glue(args.reps)
        return
    if args.panels:
        time_panels(args.rows, args.reps, torch.bfloat16 if args.dtype == "bfloat16" else torch.float32)
    elif args.heads:
        time_heads(args.rows, args.reps)
    elif args.linears:
        time_linears(args.rows, args.reps)
    elif args.model is None:
        ap.error("--model is required unless --linears, --heads, --panels or --glue")
    else:
        profile_steps(args)


if __name__ == "__main__":
    main()
