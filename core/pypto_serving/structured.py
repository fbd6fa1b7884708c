"""Structured output: grammars that constrain a request's tokens, through llguidance.

A request carries a :class:`StructuredSpec` (a JSON schema, any JSON object, a regular expression,
a list of choices, or a Lark grammar such as a forced tool call's). The server checks it once when
the request arrives (:func:`check_spec`: a bad schema or pattern is the client's error).

The worker compiles a request's grammar while the request waits, never inside a step: the engine
sends the grammar with the first command after the request is added, the worker's compile thread
starts on it at once (:meth:`GrammarCompiler.prepare`), each step's result names the requests whose
compile finished since the last one, and the scheduler admits a structured request only then, the
requests behind it going first meanwhile (vLLM's ``WAITING_FOR_FSM``). Only when nothing else could
run is it admitted before its compile is done; its first mask then waits for the compile, which
delays no other request.

The worker keeps one :class:`RequestGrammar` per constrained request: per step it writes the allowed-token
bitmask of each of the request's logits rows into one host array (:func:`fill_step_mask`, on a
thread while the step's forward runs: the masks depend only on the tokens accepted before it), the
step uploads it once, and the sampler masks the disallowed tokens to ``-inf`` on the device
(:func:`apply_bitmask`). Rows that allow few tokens (most grammar states outside free text) are
listed by id on the host, and so are rows that allow nearly every token (:class:`SparseRows`): the
sampler masks those by a fill and a scatter, a fraction of unpacking a bitmask over the vocabulary,
and draws unfiltered rows of the first kind over their allowed tokens. Accepted tokens
then advance the matcher, so the next step's mask is exact under async scheduling too.

Rows that follow drafts (speculative decoding) get the mask of the grammar state after those drafts:
the matcher consumes them, fills the row, and rolls back. A draft the grammar refuses can never be
accepted (the target token at its position is masked to the grammar), so the rows past it are left
unmasked: they are always discarded.

When the grammar is complete the matcher allows only the end-of-sequence tokens, so a constrained
request ends with EOS (or at ``max_tokens``). The grammar's end is the output's end: its EOS stops
the request whatever ``ignore_eos`` says, and before ``min_tokens`` the mask holds EOS back only
while the grammar allows something else (:class:`RequestGrammar`).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import os
import threading
import time
from collections import OrderedDict
from collections.abc import Sequence
from concurrent.futures import CancelledError, Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass
from pathlib import Path

import llguidance
import numpy as np
import numpy.typing as npt
import torch

from .request import StructuredSpec

__all__ = [
    "GRAMMAR_FAILED",
    "GrammarBudget",
    "GrammarBudgetError",
    "GrammarChecker",
    "GrammarCompiler",
    "GrammarMask",
    "HostListing",
    "HostMask",
    "RequestGrammar",
    "SparseRows",
    "StructuredSpec",
    "apply_bitmask",
    "bitmask_words",
    "check_spec",
    "fill_step_mask",
    "grammar_failed",
    "grammar_text",
    "list_rows",
    "sparse_rows",
    "step_mask",
]

# Compact JSON: flexible whitespace lets a sampled model pad with blanks until max_tokens cuts the
# document short. A schema may still ask for whitespace through its own "x-guidance" options.
_JSON_DEFAULTS: llguidance._lib.JsonCompileOptions = {"whitespace_flexible": False}
_MAX_CHOICES = 1024
_CACHE_SIZE = 256  # grammars (by text) whose verdict or compiled template is kept
_COMPILE_NICE = 10  # compile threads' nice: idle CPU only, where steps and the event loop compete
_TemplateKey = tuple[StructuredSpec, tuple[int, ...]]  # a grammar and the EOS ids that end it


def grammar_text(spec: StructuredSpec) -> str:
    """The llguidance grammar of ``spec``; ``ValueError`` when ``spec`` is not well formed."""
    if spec.kind == "json":
        return str(llguidance.LLMatcher.grammar_from_json_schema(spec.source, defaults=_JSON_DEFAULTS))
    if spec.kind == "json_object":
        return str(llguidance.LLMatcher.grammar_from_json_schema('{"type": "object"}', defaults=_JSON_DEFAULTS))
    if spec.kind == "regex":
        return str(llguidance.LLMatcher.grammar_from_regex(spec.source))
    if spec.kind == "lark":
        return str(llguidance.LLMatcher.grammar_from_lark(spec.source))
    choices = json.loads(spec.source)
    if not isinstance(choices, list) or not choices or not all(isinstance(c, str) and c for c in choices):
        raise ValueError("guided_choice must be a non-empty list of non-empty strings")
    if len(choices) > _MAX_CHOICES:
        raise ValueError(f"guided_choice allows at most {_MAX_CHOICES} choices")
    # Lark string literals take JSON's escapes, so json.dumps quotes any choice exactly.
    alternatives = " | ".join(json.dumps(c, ensure_ascii=False) for c in choices)
    return str(llguidance.LLMatcher.grammar_from_lark(f"start: {alternatives}"))


def check_spec(spec: StructuredSpec) -> None:
    """Raises ``ValueError`` naming the problem when ``spec``'s grammar cannot be built (without a
    tokenizer: the server's :class:`GrammarChecker` builds what the worker builds). Once per grammar
    text: an engine adds a request's prompts one by one."""
    error = _spec_error(spec)
    if error is not None:
        raise ValueError(error)


@functools.lru_cache(maxsize=_CACHE_SIZE)
def _spec_error(spec: StructuredSpec) -> str | None:
    try:
        grammar = grammar_text(spec)
    except ValueError as e:
        return f"{_what(spec)} is invalid: {e}"
    error = llguidance.LLMatcher.validate_grammar(grammar, limits=parser_limits())
    return f"{_what(spec)} is invalid: {_first_line(error)}" if error else None


def _what(spec: StructuredSpec) -> str:
    names = {"json": "the JSON schema", "json_object": "json_object", "regex": "the regex", "choice": "the choice list"}
    return names.get(spec.kind, "the grammar")


#: How a request's error starts when its grammar failed in the worker (a lexer or parser limit met
#: past the server's probe, or a replay after preemption): the client's grammar, not the server, is at
#: fault, so the server answers a 400 naming the field that sent it.
GRAMMAR_FAILED = "structured output: "


def grammar_failed(error: str | None) -> bool:
    """Whether a sequence's ``error`` is its grammar failing in the worker (:data:`GRAMMAR_FAILED`)."""
    return error is not None and error.startswith(GRAMMAR_FAILED)


# Steps the server's check walks past a grammar's first mask. llguidance builds its lexer lazily, so
# some errors appear only once a token is consumed: a regex whose derivatives explode (``a{1000000}``:
# "too many expressions constructed") or a row past ``max_items_in_row`` (a 5,000-branch anyOf).
_PROBE_STEPS = 4


def parser_limits() -> llguidance.LLParserLimits:
    """llguidance's resource limits, the same in the server's check and in the worker: its default
    fuel (deterministic bounds on the lexer's and parser's work per build and per step), without the
    parser's state in error messages, which go to clients."""
    return llguidance.LLParserLimits(verbose_errors=False)


def build_matcher(tok: llguidance.LLTokenizer, text: str) -> llguidance.LLMatcher:
    """A matcher of the grammar ``text`` with its first mask computed: llguidance builds the lexer
    over the token trie there (the bulk of a big grammar's cost), and deep copies share what it built."""
    matcher = llguidance.LLMatcher(tok, text, log_level=0, limits=parser_limits())
    if not matcher.is_error():
        row = np.empty(bitmask_words(tok.vocab_size), dtype=np.int32)
        matcher.unsafe_compute_mask_ptr(row.ctypes.data, row.nbytes)
    return matcher


def _first_line(error: str) -> str:
    return error.split("\n<state>", 1)[0].strip()


def probe(matcher: llguidance.LLMatcher, tok: llguidance.LLTokenizer, steps: int = _PROBE_STEPS) -> str | None:
    """llguidance's error on a copy of ``matcher`` walking ``steps`` tokens (the lowest allowed id
    other than EOS each time), None when it meets none: the errors a grammar raises on its first
    tokens, where the lexer and the parser's rows are first built."""
    m = matcher.deep_copy()
    row = np.empty(bitmask_words(tok.vocab_size), dtype=np.int32)
    eos = np.array(tok.eos_tokens or [tok.eos_token], dtype=np.int64)
    for _ in range(steps + 1):
        if not m.is_error() and not m.is_stopped():
            m.unsafe_compute_mask_ptr(row.ctypes.data, row.nbytes)
        if m.is_error():
            return _first_line(m.get_error())
        if m.is_stopped():
            return None
        allowed = np.flatnonzero(np.unpackbits(row.view(np.uint8), bitorder="little")[: tok.vocab_size])
        allowed = allowed[~np.isin(allowed, eos)]
        if not allowed.size:
            return None
        m.consume_token(int(allowed[0]))
    return _first_line(m.get_error()) if m.is_error() else None


@dataclass(frozen=True, slots=True)
class GrammarBudget:
    """What one request's grammar may cost the server: seconds to compile and bytes of grammar text
    (the settings ``grammar_compile_timeout`` and ``grammar_max_bytes``, named in the 400s)."""

    timeout: float = 5.0
    max_bytes: int = 256 * 1024


class GrammarBudgetError(ValueError):
    """A grammar over the :class:`GrammarBudget`; the message names the setting."""


@dataclass(frozen=True, slots=True)
class _Verdict:
    error: str | None = None
    over_budget: bool = False


def _yield_cpu() -> None:
    """Lowers the calling thread's scheduling priority (Linux sets ``nice`` per thread), so a long
    compile takes only the CPU that the event loop, the step loop and the forward leave idle: on a
    machine with as few cores as compile threads it would otherwise slow every other request's steps."""
    with contextlib.suppress(AttributeError, OSError):  # not Linux, or not permitted: full priority
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), _COMPILE_NICE)


class GrammarChecker:
    """The server's check of request grammars, before they are queued: it builds what the worker
    builds (the matcher over the model's tokenizer, its first mask) and walks a few tokens, where
    llguidance's errors appear, so that a grammar the worker would fail is the client's 400 with the
    library's reason, never a failed generation.

    Each grammar text is compiled once (a bounded cache of verdicts: a request's prompts and choices,
    and clients repeating a schema, share one compile), on the checker's own few threads (llguidance
    drops the GIL while it builds, so the event loop and the step loop never wait on it), and within
    the :class:`GrammarBudget`: past its size or its time the request is a 400 naming the setting,
    answered at the deadline while the bounded compile finishes in the background."""

    def __init__(
        self,
        compiler: GrammarCompiler,
        budget: GrammarBudget,
        eos_token_ids: tuple[int, ...] = (),
        threads: int = 2,
        cache_size: int = _CACHE_SIZE,
    ) -> None:
        self._compiler = compiler
        self.budget = budget
        self._eos = eos_token_ids
        self._cache_size = cache_size
        self._lock = threading.Lock()
        self._verdicts: OrderedDict[StructuredSpec, Future[_Verdict]] = OrderedDict()
        self._pool = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="grammar-check", initializer=_yield_cpu)

    def check(self, spec: StructuredSpec) -> None:
        """Blocks until ``spec`` is checked, at most the budget's seconds (call it off the event loop);
        ``ValueError`` naming the problem, :class:`GrammarBudgetError` past the budget."""
        try:
            verdict = self._verdict(spec).result(timeout=self.budget.timeout)
        except FutureTimeout:
            raise GrammarBudgetError(self._too_slow(spec)) from None
        if verdict.error is not None:
            raise (GrammarBudgetError if verdict.over_budget else ValueError)(verdict.error)

    async def check_async(self, spec: StructuredSpec) -> None:
        """:meth:`check` on the event loop: it awaits the checker's thread, never blocking the loop."""
        future = asyncio.wrap_future(self._verdict(spec))
        try:
            verdict = await asyncio.wait_for(asyncio.shield(future), self.budget.timeout)
        except TimeoutError:
            raise GrammarBudgetError(self._too_slow(spec)) from None
        if verdict.error is not None:
            raise (GrammarBudgetError if verdict.over_budget else ValueError)(verdict.error)

    def warm(self) -> None:
        """Builds the llguidance tokenizer now (a few hundred ms over a 150k-token vocabulary, holding
        the GIL throughout): at start-up, before serving, rather than on the first grammar request,
        where it would pause the event loop and every stream once."""
        self._compiler.tokenizer(self._eos)

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)

    def _verdict(self, spec: StructuredSpec) -> Future[_Verdict]:
        with self._lock:
            future = self._verdicts.get(spec)
            if future is not None:
                self._verdicts.move_to_end(spec)
                return future
            future = self._verdicts[spec] = self._pool.submit(self._compile, spec)
            if len(self._verdicts) > self._cache_size:
                done = [k for k, f in self._verdicts.items() if f.done()]
                for key in done[: len(self._verdicts) - self._cache_size]:
                    del self._verdicts[key]
            return future

    def _compile(self, spec: StructuredSpec) -> _Verdict:
        start = time.monotonic()
        try:
            text = grammar_text(spec)
        except ValueError as e:
            return _Verdict(f"{_what(spec)} is invalid: {e}")
        size = len(text.encode())
        if size > self.budget.max_bytes:
            message = (
                f"{_what(spec)} compiles to {size} bytes of grammar, more than grammar_max_bytes="
                f"{self.budget.max_bytes}; simplify it"
            )
            return _Verdict(message, over_budget=True)
        tok = self._compiler.tokenizer(self._eos)
        error = probe(build_matcher(tok, text), tok)
        if error is not None:
            return _Verdict(f"{_what(spec)} is invalid: {error}")
        if time.monotonic() - start > self.budget.timeout:  # the verdict stays for the same text
            return _Verdict(self._too_slow(spec), over_budget=True)
        return _Verdict()

    def _too_slow(self, spec: StructuredSpec) -> str:
        return f"{_what(spec)} did not compile within grammar_compile_timeout={self.budget.timeout}s; simplify it"


class GrammarCompiler:
    """The worker's llguidance tokenizer (built once from ``tokenizer.json``, per set of EOS ids) and
    the matchers made from it.

    A grammar is compiled once per text and EOS set, on the compiler's thread, into a template (a
    bounded cache: a request's ``n`` sequences and prompts, and repeated schemas, share it); each
    sequence's matcher is a deep copy of it (microseconds). The compile starts when the request is
    added (:meth:`prepare`, before it is scheduled), and :meth:`compiled` tells the scheduler when it
    is done, so the request is admitted with its template ready: no step waits on it, unless nothing
    else could run (then its first mask waits for it, beside the forward when masks overlap)."""

    __slots__ = ("_lock", "_path", "_pool", "_requests", "_templates", "_text", "_tokenizers", "_unreported")

    def __init__(self, tokenizer_dir: str | Path | None) -> None:
        self._path = Path(tokenizer_dir) / "tokenizer.json" if tokenizer_dir is not None else None
        self._text: str | None = None
        self._tokenizers: dict[tuple[int, ...], llguidance.LLTokenizer] = {}
        self._templates: OrderedDict[_TemplateKey, Future[llguidance.LLMatcher]] = OrderedDict()
        self._lock = threading.Lock()
        self._pool: ThreadPoolExecutor | None = None
        # Per live request given to prepare(): its template, kept past the cache's bound until the
        # request is forgotten; and those whose compile is done but not yet reported.
        self._requests: dict[str, tuple[_TemplateKey, Future[llguidance.LLMatcher]]] = {}
        self._unreported: dict[str, Future[llguidance.LLMatcher]] = {}

    def tokenizer(self, eos_token_ids: tuple[int, ...]) -> llguidance.LLTokenizer:
        with self._lock:
            tok = self._tokenizers.get(eos_token_ids)
            if tok is None:
                if self._text is None:
                    if self._path is None or not self._path.is_file():
                        raise ValueError(f"structured output needs the model's tokenizer.json (none at {self._path})")
                    self._text = self._path.read_text()
                eos = list(eos_token_ids) if eos_token_ids else None
                tok = self._tokenizers[eos_token_ids] = llguidance.LLTokenizer(self._text, eos_token=eos)
            return tok

    def matcher(
        self, spec: StructuredSpec, eos_token_ids: tuple[int, ...], min_tokens: int = 0, request_id: str | None = None
    ) -> RequestGrammar:
        """A fresh grammar state of ``spec`` for a request that ends at ``eos_token_ids`` and holds EOS
        back for its first ``min_tokens`` outputs (see :class:`RequestGrammar`); its matcher comes when
        the template is compiled: the one :meth:`prepare` started for ``request_id``, if any."""
        tok = self.tokenizer(eos_token_ids)
        prepared = self._requests.get(request_id) if request_id is not None else None
        template = prepared[1] if prepared is not None else self.template(spec, eos_token_ids)
        grammar = RequestGrammar(template, bitmask_words(tok.vocab_size), tok.vocab_size)
        grammar.what = _what(spec)
        grammar.hold_eos(eos_token_ids, min_tokens)
        return grammar

    def template(self, spec: StructuredSpec, eos_token_ids: tuple[int, ...]) -> Future[llguidance.LLMatcher]:
        """The compiled matcher of ``spec`` (first mask computed), compiled once on the compiler's
        thread; its error, if any, is the matcher's."""
        key = (spec, eos_token_ids)
        with self._lock:
            future = self._templates.get(key)
            if future is not None:
                self._templates.move_to_end(key)
                return future
            if self._pool is None:
                self._pool = ThreadPoolExecutor(
                    max_workers=1, thread_name_prefix="grammar-compile", initializer=_yield_cpu
                )
            future = self._templates[key] = self._pool.submit(self._compile, spec, eos_token_ids)
            while len(self._templates) > _CACHE_SIZE:
                self._templates.popitem(last=False)
            return future

    def _compile(self, spec: StructuredSpec, eos_token_ids: tuple[int, ...]) -> llguidance.LLMatcher:
        return build_matcher(self.tokenizer(eos_token_ids), grammar_text(spec))

    def prepare(self, request_id: str, spec: StructuredSpec, eos_token_ids: tuple[int, ...]) -> None:
        """Start compiling the grammar of a request that was just added (it waits to be scheduled);
        :meth:`compiled` names it once the compile is done, and :meth:`matcher` uses that compile."""
        self.forget(request_id)  # an id used again: the old request's compile is not its own
        key = (spec, eos_token_ids)
        future = self.template(spec, eos_token_ids)
        self._requests[request_id] = (key, future)
        self._unreported[request_id] = future

    def forget(self, request_id: str) -> None:
        """The request is gone (finished, aborted): drop its compile, and cancel the compile while it
        has not started and no other request waits on it, so an aborted grammar costs no CPU."""
        self._unreported.pop(request_id, None)
        entry = self._requests.pop(request_id, None)
        if entry is None:
            return
        key, future = entry
        if any(f is future for _, f in self._requests.values()) or not future.cancel():
            return
        with self._lock:
            if self._templates.get(key) is future:
                del self._templates[key]

    def compiled(self) -> list[str]:
        """The requests given to :meth:`prepare` whose compile finished (or failed) since the last
        call: the scheduler admits them with no step waiting on their grammar."""
        done = [rid for rid, future in self._unreported.items() if future.done()]
        for rid in done:
            del self._unreported[rid]
        return done


def bitmask_words(vocab: int) -> int:
    """int32 words of one row's bitmask over a ``vocab``-token vocabulary."""
    return (vocab + 31) // 32


class RequestGrammar:
    """One request's grammar state: the tokens it accepted so far, and the mask of what may follow.

    ``min_tokens`` (:meth:`hold_eos`) lives in the mask: before it, a row whose grammar state allows
    EOS and any other token allows only the others; a state that allows nothing but EOS (the
    grammar is complete and cannot go on) keeps it, and the request ends there: the grammar wins."""

    __slots__ = (
        "_eos_keep",
        "_eos_words",
        "_failed",
        "_hold_until",
        "_made",
        "_pending",
        "num_tokens",
        "vocab",
        "what",
        "words",
    )

    def __init__(
        self, matcher: llguidance.LLMatcher | Future[llguidance.LLMatcher], words: int, vocab: int | None = None
    ) -> None:
        # A compiled matcher, or the template being compiled (:class:`GrammarCompiler`), copied at first use.
        self._made = matcher if isinstance(matcher, llguidance.LLMatcher) else None
        self._pending = None if isinstance(matcher, llguidance.LLMatcher) else matcher
        self._failed: str | None = None  # the template could not be compiled
        self.what = "the grammar"
        self.words = words  # int32 words of one row of this grammar's bitmask
        self.vocab = 32 * words if vocab is None else vocab  # the tokenizer's tokens: no id past them is allowed
        self.num_tokens = 0  # tokens accepted (the request's outputs): row j of a fill draws output num_tokens + j
        self._hold_until = 0  # outputs before which EOS is held back (min_tokens)
        self._eos_words = np.zeros(0, dtype=np.int64)  # the bitmask words holding EOS bits
        self._eos_keep = np.zeros(0, dtype=np.uint32)  # those words' bits other than EOS

    def hold_eos(self, eos_token_ids: Sequence[int], until: int) -> None:
        """Hold ``eos_token_ids`` back while fewer than ``until`` tokens are accepted, wherever the
        grammar allows any other token."""
        bits: dict[int, int] = {}
        for t in eos_token_ids:
            if 0 <= t < self.vocab:
                bits[t >> 5] = bits.get(t >> 5, 0) | 1 << (t & 31)
        self._eos_words = np.array(sorted(bits), dtype=np.int64)
        self._eos_keep = np.array([~bits[w] & 0xFFFFFFFF for w in sorted(bits)], dtype=np.uint32)
        self._hold_until = until if bits else 0

    @property
    def _matcher(self) -> llguidance.LLMatcher | None:
        """This request's matcher, once its template is compiled (None when that failed)."""
        if self._pending is not None:
            try:
                self._made = self._pending.result().deep_copy()
            except ValueError as e:
                self._failed = f"{self.what} is invalid: {e}"
            except CancelledError:  # GrammarCompiler.forget cancels only compiles nobody waits on
                self._failed = f"{self.what} was not compiled: its compile was cancelled"
            self._pending = None
        return self._made

    @property
    def error(self) -> str | None:
        m = self._matcher
        if m is None:
            return self._failed
        return _first_line(str(m.get_error())) if m.is_error() else None

    def advance(self, tokens: list[int]) -> bool:
        """Accepts ``tokens`` (sampled under this grammar's masks); False when the grammar is in error.
        Past the grammar's end nothing is consumed: the mask keeps allowing only EOS."""
        self.num_tokens += len(tokens)
        m = self._matcher
        if m is None:
            return False
        for t in tokens:
            if m.is_stopped():
                break
            m.consume_token(t)
        return not m.is_error()

    def fill(self, drafts: list[int], out: npt.NDArray[np.int32]) -> None:
        """Row ``j`` of ``out`` (``[len(drafts) + 1, words]``) := the mask after ``drafts[:j]``; every
        token when the grammar failed (the request fails when it advances)."""
        m = self._matcher
        if m is None or m.is_error():
            out[:] = -1
            return
        consumed = 0
        for j in range(len(drafts) + 1):
            row = out[j]
            if j > 0 and (m.is_stopped() or m.try_consume_tokens([drafts[j - 1]]) != 1):
                out[j:] = -1  # rows past a draft the grammar refuses are always discarded
                break
            consumed += j > 0
            m.unsafe_compute_mask_ptr(row.ctypes.data, row.nbytes)
            if self.num_tokens + j < self._hold_until:
                self._hold_back_eos(row)
        if consumed:
            m.rollback(consumed)

    def _hold_back_eos(self, row: npt.NDArray[np.int32]) -> None:
        """Clears ``row``'s EOS bits unless EOS is all it allows."""
        bits = row.view(np.uint32)
        saved = bits[self._eos_words]
        if not (saved & ~self._eos_keep).any():
            return  # EOS is not allowed here anyway
        bits[self._eos_words] = saved & self._eos_keep
        if not bits.any():
            bits[self._eos_words] = saved  # the grammar is complete: its end is the output's end


@dataclass(frozen=True, slots=True, kw_only=True)
class SparseRows:
    """The constrained rows of a step listed by id, on the host where the bitmask is filled: rows
    that allow few tokens (3/8 of the bitmask's width at most: a JSON document's structure, a regex
    of words) by their allowed ids, rows that disallow as few (inside a JSON string) by their
    disallowed ids. The sampler masks
    them by filling and scattering, never unpacking their bitmasks, and draws unfiltered rows of the
    first kind over their allowed tokens, never running full-row ``exp`` passes over ``-inf``."""

    rows: tuple[int, ...]  # logits rows listed by allowed id, ascending
    ids: torch.Tensor  # [S, K] long: each row's allowed ids ascending, padded with its first id
    pad: torch.Tensor  # [S, K] bool: the padding
    banned_rows: tuple[int, ...]  # logits rows listed by disallowed id, ascending
    banned: torch.Tensor  # [B, K'] long: each row's disallowed ids below ``vocab``, padded with its first
    vocab: int  # the tokenizer's tokens: the rows listed by disallowed id disallow every token past them
    max_id: int  # the largest listed id: the lists apply only when it lies inside the logits' vocabulary
    dense: torch.Tensor  # [D] long: positions in ``GrammarMask.rows`` of the rows not listed
    num_dense: int
    # Positions of rows that disallow few tokens but were not listed (a step whose rows are all
    # greedy needs no list: their argmax is checked against their bitmask); they are in ``dense``,
    # and ``unchecked`` holds the rest of ``dense``.
    checked: torch.Tensor | None = None  # [C] long
    unchecked: torch.Tensor | None = None  # [D - C] long


@dataclass(frozen=True, slots=True)
class GrammarMask:
    """One step's grammar masks on the device: the logits rows they constrain and their bitmasks,
    and which of those rows allow few enough tokens to be listed (``sparse``)."""

    rows: torch.Tensor  # [R] long
    bitmask: torch.Tensor  # [R, W] int32
    sparse: SparseRows | None = None


@dataclass(frozen=True, slots=True, kw_only=True)
class HostListing:
    """:class:`SparseRows` on the host, before the upload (the fields of the same names)."""

    few: list[int]  # positions in the step's constrained rows of those listed by allowed id
    ids: npt.NDArray[np.int64]
    pad: npt.NDArray[np.bool_]
    most: list[int]  # positions of those listed by disallowed id
    banned: npt.NDArray[np.int64]
    vocab: int
    dense: list[int]
    checked: tuple[int, ...] = ()

    def to(self, rows: list[int], device: torch.device) -> SparseRows:
        """The listing of the constrained logits ``rows`` on ``device``."""
        return SparseRows(
            rows=tuple(rows[i] for i in self.few),
            ids=torch.from_numpy(self.ids).to(device),
            pad=torch.from_numpy(self.pad).to(device),
            banned_rows=tuple(rows[i] for i in self.most),
            banned=torch.from_numpy(self.banned).to(device),
            vocab=self.vocab,
            max_id=max(int(self.ids.max(initial=0)), int(self.banned.max(initial=0))),
            dense=torch.tensor(self.dense, dtype=torch.long, device=device),
            num_dense=len(self.dense),
            checked=torch.tensor(self.checked, dtype=torch.long, device=device) if self.checked else None,
            unchecked=torch.tensor(
                [i for i in self.dense if i not in set(self.checked)], dtype=torch.long, device=device
            )
            if self.checked
            else None,
        )


@dataclass(frozen=True, slots=True, kw_only=True)
class HostMask:
    """One step's grammar masks on the host: everything :class:`GrammarMask` holds, before the upload.
    Filling it reads only the grammars' states, so it can run beside the step's forward."""

    rows: list[int]  # logits rows constrained, ascending
    bitmask: npt.NDArray[np.int32]  # [R, W]
    listing: HostListing | None

    def to(self, device: torch.device) -> GrammarMask:
        """The masks on ``device``: one upload per array."""
        return GrammarMask(
            torch.tensor(self.rows, dtype=torch.long, device=device),
            torch.from_numpy(self.bitmask).to(device),
            None if self.listing is None else self.listing.to(self.rows, device),
        )


def fill_step_mask(
    entries: Sequence[tuple[RequestGrammar | None, int, list[int]]], greedy: bool = False
) -> HostMask | None:
    """The host masks of one step whose requests, in logits-row order, are ``(grammar, logits rows,
    drafts)``: every row of a constrained request, and the listing of the rows that allow few or
    nearly all tokens (``greedy``: a step whose rows all take their argmax; the rows that allow
    nearly all tokens are marked, not listed); None when no request of the step is constrained. It
    only reads the grammars (no torch, llguidance and numpy release the GIL), so a thread can run it
    during the forward."""
    rows: list[int] = []
    parts: list[tuple[RequestGrammar, list[int], int]] = []
    first = 0
    for grammar, n, drafts in entries:
        if grammar is not None and n:
            parts.append((grammar, drafts[: n - 1], len(rows)))
            rows.extend(range(first, first + n))
        first += n
    if not parts:
        return None
    host = np.empty((len(rows), parts[0][0].words), dtype=np.int32)
    for grammar, drafts, at in parts:
        grammar.fill(drafts, host[at : at + len(drafts) + 1])
    return HostMask(rows=rows, bitmask=host, listing=list_rows(host, parts[0][0].vocab, greedy))


def step_mask(
    entries: Sequence[tuple[RequestGrammar | None, int, list[int]]], device: torch.device
) -> GrammarMask | None:
    """:func:`fill_step_mask`'s masks uploaded to ``device`` (None when no request is constrained)."""
    host = fill_step_mask(entries)
    return None if host is None else host.to(device)


def sparse_rows(
    host: npt.NDArray[np.int32], rows: list[int], device: torch.device, vocab: int | None = None
) -> SparseRows | None:
    """The rows of the host bitmask ``host [R, W]`` (of logits ``rows``) listed by id on ``device``
    (:func:`list_rows`); None when no row is listed."""
    listing = list_rows(host, vocab)
    return None if listing is None else listing.to(rows, device)


def list_rows(host: npt.NDArray[np.int32], vocab: int | None = None, greedy: bool = False) -> HostListing | None:
    """The rows of the host bitmask ``host [R, W]`` listed by id: those that allow between 1 and
    ``12 W`` tokens (3/8 of the bitmask's width) by allowed id, those that disallow between 1 and
    ``12 W`` of the first ``vocab`` tokens (default ``32 W``; the tokens past them are disallowed
    anyway) by disallowed id, unless ``greedy``: then those are only marked (``checked``). None when
    no row is listed or marked."""
    words = host.shape[1]
    vocab = 32 * words if vocab is None else min(vocab, 32 * words)
    counts = np.bitwise_count(host.view(np.uint32)).sum(axis=1).tolist()
    few = [i for i, c in enumerate(counts) if 0 < c <= 12 * words]
    most = [i for i, c in enumerate(counts) if 0 < vocab - c <= 12 * words]
    if not few and not most:
        return None
    checked: tuple[int, ...] = ()
    if greedy:
        checked, most = tuple(most), []
    ids, pad = _listing(host, few, True)
    banned, _ = _listing(host, most, False, vocab)
    dense = sorted(set(range(len(counts))) - set(few) - set(most))
    return HostListing(few=few, ids=ids, pad=pad, most=most, banned=banned, vocab=vocab, dense=dense, checked=checked)


def _listing(
    host: npt.NDArray[np.int32], at: list[int], bit: bool, vocab: int | None = None
) -> tuple[npt.NDArray[np.int64], npt.NDArray[np.bool_]]:
    """The ids below ``vocab`` whose bit is ``bit`` in each of ``host``'s rows ``at`` (each has
    some), ascending and padded to one width with the row's first id; and where the padding is."""
    if not at:
        return np.zeros((0, 0), dtype=np.int64), np.zeros((0, 0), dtype=np.bool_)
    bits = np.unpackbits(host[at].view(np.uint8), axis=1, bitorder="little").view(np.bool_)
    # Row by row: numpy's 1-D nonzero runs several times faster than its 2-D one.
    lists = [np.flatnonzero(row if bit else ~row) for row in bits]
    if vocab is not None:
        lists = [x[: np.searchsorted(x, vocab)] for x in lists]
    out = np.empty((len(at), max(len(x) for x in lists)), dtype=np.int64)
    pad = np.zeros(out.shape, dtype=np.bool_)
    for j, listed in enumerate(lists):
        out[j, : len(listed)] = listed
        out[j, len(listed) :] = listed[0]
        pad[j, len(listed) :] = True
    return out, pad


def apply_bitmask(logits: torch.Tensor, rows: torch.Tensor, bitmask: torch.Tensor) -> torch.Tensor:
    """``logits [N, V]`` with the tokens ``bitmask [R, W]`` (int32, bit ``t % 32`` of word ``t // 32``)
    disallows set to ``-inf`` in ``rows [R]``; tokens past the bitmask's ``32 W`` are disallowed."""
    n, vocab = logits.shape
    # Bytes through a 256-entry table of their 8 bits: a third of the time of shifting int32 words.
    # The table is made where the mask is (two tiny ops): no host tensor is copied in per step.
    table = _byte_bits(bitmask.device)
    allowed = table.index_select(0, bitmask.view(torch.uint8).flatten().int()).view(bitmask.shape[0], -1)
    width = allowed.shape[1]
    if width < vocab:
        pad = torch.zeros(allowed.shape[0], vocab - width, dtype=torch.bool, device=allowed.device)
        allowed = torch.cat([allowed, pad], dim=1)
    elif width > vocab:
        allowed = allowed.narrow(1, 0, vocab)
    banned = torch.logical_not(allowed)
    if rows.shape[0] == n:  # the step's rows are all constrained, in order (step_mask lists rows ascending)
        return logits.masked_fill(banned, float("-inf"))
    masked = logits.index_select(0, rows).masked_fill_(banned, float("-inf"))
    return logits.index_copy(0, rows, masked)


def _byte_bits(device: torch.device) -> torch.Tensor:
    """``[256, 8]`` bool on ``device``: row b holds the 8 bits of byte b, least significant first."""
    return ((torch.arange(256, device=device).unsqueeze(1) >> torch.arange(8, device=device)) & 1).bool()
