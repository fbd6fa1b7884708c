"""Requests: sampling parameters, the one record of a sequence in the engine process, and the outputs users get."""

from __future__ import annotations

import enum
import math
import time
from dataclasses import dataclass, field
from typing import Any, Literal

__all__ = [
    "GREEDY_TEMPERATURE",
    "MAX_LOGIT_BIAS",
    "CompletionOutput",
    "FinishReason",
    "KVState",
    "LoopDraw",
    "OutputState",
    "Request",
    "RequestMetrics",
    "RequestOutput",
    "RequestStatus",
    "SamplingParams",
    "SchedState",
    "StructuredSpec",
]


@dataclass(frozen=True, slots=True)
class StructuredSpec:
    """What a request's output must match (structured output; see :mod:`pypto_serving.structured`).

    ``kind`` ``json``: ``source`` is a JSON schema (as JSON text); ``json_object``: any JSON object
    (``source`` is unused); ``regex``: ``source`` is the pattern, matched whole; ``choice``: ``source``
    is a JSON array of the allowed strings; ``lark``: ``source`` is a grammar in llguidance's Lark
    dialect (the server's forced tool calls, see :mod:`pypto_serving.parsers.grammar`). Checked where
    requests enter (the server's 400s, ``structured.check_spec``); the worker fails the one request
    whose grammar cannot be built.
    """

    kind: Literal["json", "json_object", "regex", "choice", "lark"]
    source: str = ""


# Temperatures below this are greedy (temperature 0), as vLLM's ``_SAMPLING_EPS``: the sampler divides
# the logits by the temperature in float32, where 1e-39 is a denormal and 5e-324 is 0, so such a
# temperature would sample the same garbage for every seed; one this small differs from argmax only
# between near-tied logits.
GREEDY_TEMPERATURE = 1e-5


@dataclass(slots=True)
class SamplingParams:
    """How to pick tokens and when to stop. Invalid values raise ``ValueError`` naming the field."""

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: off
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    seed: int | None = None
    max_tokens: int | None = 16  # None: up to the context length
    # Before this many outputs EOS and stop token ids are banned; under ``structured`` EOS only while
    # the grammar allows another token (a complete grammar ends the request: see structured.py).
    min_tokens: int = 0
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False  # EOS does not end the request; a grammar's EOS, its end, still does
    n: int = 1
    logprobs: int | None = None
    skip_special_tokens: bool = True
    structured: StructuredSpec | None = None  # a grammar the output must match (structured output)
    logit_bias: dict[int, float] = field(default_factory=dict)  # token id -> added to its logit
    allowed_token_ids: list[int] | None = None  # only these tokens may be sampled
    # Banned token sequences: a word's last token is banned wherever the output ends with the rest.
    bad_words_token_ids: list[list[int]] = field(default_factory=list)
    include_stop_str_in_output: bool = False  # keep the stop string that ended the text in it
    prompt_logprobs: int | None = None  # logprobs of every prompt token (after the first), plus the top ones
    # Under scheduling_policy "priority": lower is served first (vLLM's sense); under "fcfs" only 0 is accepted.
    priority: int = 0
    # The LoRA adapter (a name in lora_modules) whose weights compute this request; None: the base model.
    lora: str | None = None
    # Disaggregated serving (vLLM's field): {"do_remote_decode": true} on a prefill engine; the prefill
    # output's kv_transfer_params on a decode engine (docs/disaggregated.md).
    kv_transfer_params: dict[str, Any] | None = None

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop)
        self.stop_token_ids = list(self.stop_token_ids)
        if self.top_k == -1:
            self.top_k = 0
        _check(math.isfinite(self.temperature) and self.temperature >= 0, "temperature", self.temperature, ">= 0")
        if self.temperature < GREEDY_TEMPERATURE:
            self.temperature = 0.0  # greedy: see GREEDY_TEMPERATURE
        _check(0 < self.top_p <= 1, "top_p", self.top_p, "in (0, 1]")
        _check(0 <= self.top_k < _INT64, "top_k", self.top_k, "-1, 0 (off) or a positive integer below 2**63")
        _check(0 <= self.min_p <= 1, "min_p", self.min_p, "in [0, 1]")
        _check(-2 <= self.presence_penalty <= 2, "presence_penalty", self.presence_penalty, "in [-2, 2]")
        _check(-2 <= self.frequency_penalty <= 2, "frequency_penalty", self.frequency_penalty, "in [-2, 2]")
        _check(0 < self.repetition_penalty <= 2, "repetition_penalty", self.repetition_penalty, "in (0, 2]")
        _check(self.max_tokens is None or 1 <= self.max_tokens < _INT64, "max_tokens", self.max_tokens, "in [1, 2**63)")
        _check(0 <= self.min_tokens < _INT64, "min_tokens", self.min_tokens, "in [0, 2**63)")
        _check(
            self.max_tokens is None or self.min_tokens <= self.max_tokens,
            "min_tokens",
            self.min_tokens,
            "<= max_tokens",
        )
        _check(1 <= self.n < _INT64, "n", self.n, "in [1, 2**63)")
        _check(self.logprobs is None or 0 <= self.logprobs <= 20, "logprobs", self.logprobs, "in [0, 20]")
        _check(all(isinstance(s, str) and s for s in self.stop), "stop", self.stop, "non-empty strings")
        _check(all(_is_utf8(s) for s in self.stop), "stop", self.stop, "valid Unicode (no unpaired surrogates)")
        _check(
            all(0 <= t < _INT64 for t in self.stop_token_ids),
            "stop_token_ids",
            self.stop_token_ids,
            "token ids in [0, 2**63)",
        )
        _check(self.seed is None or 0 <= self.seed < 2**63, "seed", self.seed, "in [0, 2**63)")
        _check(-_INT64 <= self.priority < _INT64, "priority", self.priority, "in [-2**63, 2**63)")
        self._check_token_fields()

    def _check_token_fields(self) -> None:
        self.logit_bias = {int(t): float(b) for t, b in self.logit_bias.items()}
        _check(
            len(self.logit_bias) <= MAX_LOGIT_BIAS,
            "logit_bias",
            len(self.logit_bias),
            f"at most {MAX_LOGIT_BIAS} entries",
        )
        _check(
            all(0 <= t < _INT64 and math.isfinite(b) and -100 <= b <= 100 for t, b in self.logit_bias.items()),
            "logit_bias",
            self.logit_bias,
            "token ids mapped to biases in [-100, 100]",
        )
        if self.allowed_token_ids is not None:
            self.allowed_token_ids = list(self.allowed_token_ids)
            _check(
                bool(self.allowed_token_ids) and all(0 <= t < _INT64 for t in self.allowed_token_ids),
                "allowed_token_ids",
                self.allowed_token_ids,
                "a non-empty list of token ids",
            )
        self.bad_words_token_ids = [list(w) for w in self.bad_words_token_ids]
        _check(
            all(w and all(0 <= t < _INT64 for t in w) for w in self.bad_words_token_ids),
            "bad_words",
            self.bad_words_token_ids,
            "non-empty token sequences",
        )
        _check(
            self.prompt_logprobs is None or 0 <= self.prompt_logprobs <= 20,
            "prompt_logprobs",
            self.prompt_logprobs,
            "in [0, 20]",
        )

    def check_vocab(self, vocab: int) -> None:
        """Raises ``ValueError`` naming the field whose token ids fall outside a ``vocab``-token model."""
        _check(all(t < vocab for t in self.logit_bias), "logit_bias", sorted(self.logit_bias)[-1:], f"ids < {vocab}")
        ids = self.allowed_token_ids or []
        _check(all(t < vocab for t in ids), "allowed_token_ids", max(ids, default=0), f"token ids < {vocab}")
        worst = max((t for w in self.bad_words_token_ids for t in w), default=0)
        _check(worst < vocab, "bad_words", worst, f"token ids < {vocab}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def has_penalties(self) -> bool:
        return bool(self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1.0)


MAX_LOGIT_BIAS = 300  # entries of logit_bias: each is applied per step on the device

# Every integer crosses the process boundary and reaches int64 tensors: larger values are refused here,
# for the one request, instead of failing the step (or the encoder) of every request batched with it.
_INT64 = 2**63


def _is_utf8(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def _check(ok: bool, name: str, value: Any, allowed: str) -> None:
    if not ok:
        raise ValueError(f"{name}={value!r} is invalid: must be {allowed}")


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"
    FINISHED_EOS = "finished_eos"
    FINISHED_LENGTH = "finished_length"
    FINISHED_STOP = "finished_stop"
    FINISHED_ABORTED = "finished_aborted"
    FINISHED_ERROR = "finished_error"

    finished: bool  # a plain member attribute: it is read per request per step

    def __init__(self, value: str) -> None:
        self.finished = value.startswith("finished")


FinishReason = str  # "stop" | "length" | "abort" | "error" (OpenAI's vocabulary)

_FINISH_REASON = {
    RequestStatus.FINISHED_EOS: "stop",
    RequestStatus.FINISHED_STOP: "stop",
    RequestStatus.FINISHED_LENGTH: "length",
    RequestStatus.FINISHED_ABORTED: "abort",
    RequestStatus.FINISHED_ERROR: "error",
}


@dataclass(slots=True)
class RequestMetrics:
    arrival_time: float = field(default_factory=time.monotonic)
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None
    finished_time: float | None = None
    num_cached_tokens: int = 0
    num_preemptions: int = 0
    # What happened between arrival and finish, for the request's timeline (the times above are the
    # rest of it): (kind, monotonic time, first position, tokens), kind "prefill_chunk" or
    # "preempted"; at most MAX_TIMELINE_EVENTS, the later ones only counted in ``events_dropped``.
    events: list[tuple[str, float, int, int]] = field(default_factory=list)
    events_dropped: int = 0

    def note(self, kind: str, t: float, start: int = 0, num_tokens: int = 0) -> None:
        if len(self.events) < MAX_TIMELINE_EVENTS:
            self.events.append((kind, t, start, num_tokens))
        else:
            self.events_dropped += 1


MAX_TIMELINE_EVENTS = 64
"""Events one request's timeline keeps (each crosses the process boundary with every output)."""


@dataclass(slots=True)
class SchedState:
    """The scheduler's bookkeeping of one sequence; only ``scheduler.py`` writes it. Preemption
    resets the step-scoped part (``Scheduler._preempt``); the limits are derived once when the
    request is added (``Scheduler.add_request``)."""

    arrival_index: int = 0  # FCFS order; preemption picks the highest (under "priority", after the priority)
    # The step id from which results count: a preemption while building step S sets S, so results
    # of the steps before it, still in flight, are discarded (the worker dropped the request).
    valid_from: int = 0
    rejected: int = 0  # draft positions given back so far (the worker corrects positions by it)
    confirmed: int = 0  # tokens whose KV a finished step confirmed (publishable to the prefix cache)
    publish_at: int = 0  # confirmed tokens from which KVCacheManager.publish() can publish a block
    awaiting_prefill: bool = False  # a terminal prefill is in flight (for executors with a barrier)
    # Drafts the worker proposes after the last sampling entry (0 before one since (re)admission):
    # the most the next decode verifies.
    proposed: int = 0
    sent_to_worker: bool = False  # the worker holds state for it (to be released on finish/preempt)
    blocks_sent: dict[str, int] = field(default_factory=dict)  # per group: table length the worker holds
    entries_sent: int = 0  # the sum of ``blocks_sent``: compared with KVState.num_entries per step
    # False while the worker compiles the request's grammar: admission passes it over. Preemption
    # keeps it: the worker keeps the compile for the request's life.
    grammar_ready: bool = True
    # The stop rule's inputs (Scheduler._stop_status), derived once from the sampling parameters:
    pending_limit: int = 0  # prompt + output tokens at which no more output can be produced
    output_limit: int = 0  # outputs at which the request ends by length (max_tokens or the context)
    stop_ids: frozenset[int] = frozenset()  # tokens that end it once min_tokens outputs exist
    eos_ids: frozenset[int] = frozenset()  # those of stop_ids that end it as EOS (not a stop token id)
    grammar_eos: frozenset[int] = frozenset()  # end it even before min_tokens: a grammar's end
    min_tokens: int = 0
    check_text: bool = False  # it has stop strings: each committed token asks the engine's detokenizer


@dataclass(slots=True)
class KVState:
    """The KV manager's state of one sequence; only ``kv_cache.py`` writes it (the scheduler reads
    ``capacity``, ``num_entries`` and ``block_ids``)."""

    block_ids: dict[str, list[int]] = field(default_factory=dict)  # per cache group: the block table
    capacity: int = 0  # tokens every group's table covers: growing to at most this allocates nothing
    num_entries: int = 0  # table entries over all groups (tables only grow while the request holds them)
    hashes: dict[str, list[bytes]] = field(default_factory=dict)  # per group: chained keys of full blocks
    published: int = 0  # full blocks (of the smallest kind) published to the prefix cache
    window_freed: dict[str, int] = field(default_factory=dict)  # per windowed group: leading entries freed
    group_hits: dict[str, int] = field(default_factory=dict)  # per group: its longest servable prefix at lookup


@dataclass(slots=True)
class OutputState:
    """What the engine needs to report a sequence; only ``engine.py`` writes it. A user request of
    ``n`` choices is ``n`` sequences sharing one ``choices`` list (in choice order)."""

    user_request_id: str = ""
    prompt: str | None = None  # the user's text prompt (None for token ids)
    created: float = 0.0  # when the user request was added (outputs are reported in that order)
    choices: list[Request] = field(default_factory=list)
    detokenizer: Any = None  # an IncrementalDetokenizer: text output and stop strings
    changed: bool = False  # on choices[0]: an output is due (the engine's list of changed requests holds it)
    logged: bool = False  # on choices[0]: the failures of a finished request were logged (once)
    final_only: bool = False  # on choices[0]: only its finished output is reported (EngineCore.add_request)
    kv_transfer_params: dict[str, Any] | None = None  # a prefill engine's offer of this request's KV


@dataclass(slots=True, eq=False)
class Request:
    """The one record of a sequence (one of the ``n`` choices of a user request) in the engine process.

    The fields below are the sequence: identity, prompt and parameters (never change), and its
    progress (status, outputs, counts), written by the scheduler and read by everyone. Each module's
    own bookkeeping is a section written only by it: ``sched`` (:class:`SchedState`), ``kv``
    (:class:`KVState`) and ``out`` (:class:`OutputState`).
    """

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    eos_token_ids: tuple[int, ...] = ()
    sample_seed: int = 0  # the user's seed, or one the engine drew: sampling is a function of it
    status: RequestStatus = RequestStatus.WAITING
    output_token_ids: list[int] = field(default_factory=list)
    output_logprobs: list[dict[int, float]] = field(default_factory=list)
    # With SamplingParams.prompt_logprobs: entry i scores prompt token i + 1 (the first has no context).
    prompt_logprobs: list[dict[int, float]] = field(default_factory=list)
    num_computed_tokens: int = 0
    # Tokens sampled in steps still in flight (async scheduling) that are not yet appended.
    num_output_placeholders: int = 0
    num_cached_tokens: int = 0
    spec_drafted: int = 0  # draft tokens verified for this request, and how many were accepted
    spec_accepted: int = 0
    stop_reason: str | int | None = None  # the stop string or stop token id that ended it
    error: str | None = None
    metrics: RequestMetrics = field(default_factory=RequestMetrics)
    sched: SchedState = field(default_factory=SchedState)
    kv: KVState = field(default_factory=KVState)
    out: OutputState = field(default_factory=OutputState)

    # The prompt never changes after creation; a plain attribute because the scheduler reads it
    # several times per request per step.
    num_prompt_tokens: int = field(init=False)

    def __post_init__(self) -> None:
        self.num_prompt_tokens = len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return self.num_prompt_tokens + len(self.output_token_ids)

    @property
    def num_produced(self) -> int:
        """Output tokens counting those sampled by steps still in flight (async scheduling)."""
        return len(self.output_token_ids) + self.num_output_placeholders

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    def token_slice(self, start: int, end: int) -> list[int]:
        """``all_token_ids[start:end]`` without building the whole list (a decode needs one token)."""
        p = self.num_prompt_tokens
        if end <= p:
            return self.prompt_token_ids[start:end]
        if start >= p:
            return self.output_token_ids[start - p : end - p]
        return self.prompt_token_ids[start:] + self.output_token_ids[: end - p]

    @property
    def is_finished(self) -> bool:
        return self.status.finished

    @property
    def finish_reason(self) -> str | None:
        return _FINISH_REASON.get(self.status)


@dataclass(slots=True)
class CompletionOutput:
    index: int
    token_ids: list[int]
    text: str = ""
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    logprobs: list[dict[int, float]] | None = None
    error: str | None = None  # why the sequence failed, when ``finish_reason`` is "error"


@dataclass(slots=True)
class RequestOutput:
    """What a user request produced so far (vLLM-shaped)."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    num_cached_tokens: int = 0
    metrics: RequestMetrics | None = None
    # With SamplingParams.prompt_logprobs: None for the first prompt token, then each token's logprob
    # and the top ones (complete once the prompt is computed, which the first output follows).
    prompt_logprobs: list[dict[int, float] | None] | None = None
    # On a prefill engine (kv_role "prefill"), once finished: what a decode engine's request carries.
    kv_transfer_params: dict[str, Any] | None = None


@dataclass(frozen=True, slots=True)
class LoopDraw:
    """How a request's tokens are drawn one output after another: the sampler's draw
    (``pypto_serving.sampler``: temperature > 0, ``top_k`` 0 for none, ``top_p`` 1 for none, ``min_p``
    0 for none) with the uniform of ``(seed, first_index + the output's place after the first)``: a
    sampled request of a loop of forwards (:meth:`pypto_serving.Executor.sampled_steps`) and an
    executor's sampled drafts (``spec_decode.DraftRow``) alike."""

    temperature: float
    top_k: int
    top_p: float
    min_p: float
    seed: int
    first_index: int  # the output index the run's first forward samples
