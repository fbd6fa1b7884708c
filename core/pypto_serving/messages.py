"""The step messages between the engine (scheduler side) and the worker.

The engine owns request state and block accounting; the worker owns tensors. Per step the engine
sends one :class:`StepCommand` and gets one :class:`StepResult` back, both small msgspec structs
encoded as msgpack: no activation and no pickled object ever crosses the pipe.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import msgspec

from .executor import ExecutorInfo
from .request import SamplingParams, StructuredSpec

__all__ = [
    "COPIED",
    "DERIVED",
    "GrammarCompile",
    "NewRequestData",
    "ScheduledEntry",
    "StepCommand",
    "StepResult",
    "WireSampling",
    "wire_sampling",
]


class WireSampling(msgspec.Struct, frozen=True, kw_only=True):
    """A request's sampling parameters as the worker's sampler reads them: the one struct from the
    API to the sampler. Every field but the four derived ones (``DERIVED``) is the
    :class:`~pypto_serving.request.SamplingParams` field of the same name, copied by
    :func:`wire_sampling` through ``COPIED`` (lists and dicts frozen to tuples); the worker builds its
    sampler rows from these fields by name too (``runner.py``). ``tests/core/test_runner.py`` checks
    that the names agree, so a field added to one and not the other fails there."""

    temperature: float
    top_k: int
    top_p: float
    min_p: float
    presence_penalty: float
    frequency_penalty: float
    repetition_penalty: float
    has_penalties: bool  # derived: the only rows whose token history the sampler reads
    min_tokens: int
    min_tokens_banned: tuple[int, ...]  # derived: masked until min_tokens outputs exist (stop ids, EOS unless ignored)
    logprobs: int | None
    structured: StructuredSpec | None = None  # the grammar the worker masks this request's tokens to
    grammar_eos: tuple[int, ...] = ()  # derived: the tokens that end the grammar's output (the model's EOS ids)
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, bias) added to the logits
    allowed_token_ids: tuple[int, ...] | None = None  # the only tokens that may be sampled
    bad_words_token_ids: tuple[tuple[int, ...], ...] = ()  # token sequences that must not be completed
    prompt_logprobs: int | None = None  # the prompt tokens' logprobs are computed, with this many top ones
    max_tokens: int | None = None  # the request's output limit (bounds the drafts rejection sampling verifies)
    # derived: the user gave a seed (not the engine): a seeded sampled request's drafts are verified by
    # sample-and-compare, so its tokens never depend on which drafts a step verified.
    seeded: bool = False
    lora: str | None = None  # the request's LoRA adapter by name (None: the base model)


#: The wire fields computed from a request rather than copied from its SamplingParams.
DERIVED = ("has_penalties", "min_tokens_banned", "grammar_eos", "seeded")
#: The SamplingParams fields the worker reads, copied by name.
COPIED = tuple(name for name in WireSampling.__struct_fields__ if name not in DERIVED)


def _frozen(value: Any) -> Any:
    """``value`` with lists and dicts as tuples (a dict as its ``(key, value)`` pairs), nested too."""
    if isinstance(value, dict):
        return tuple(value.items())
    if isinstance(value, list):
        return tuple(_frozen(v) for v in value)
    return value


def wire_sampling(sp: SamplingParams, eos_token_ids: Sequence[int]) -> WireSampling:
    """What the worker needs of ``sp`` for a request whose model stops at ``eos_token_ids``."""
    banned = [*sp.stop_token_ids, *(() if sp.ignore_eos else eos_token_ids)]
    copied = {name: _frozen(getattr(sp, name)) for name in COPIED}
    return WireSampling(
        **copied,
        has_penalties=sp.has_penalties,
        min_tokens_banned=tuple(banned),
        grammar_eos=tuple(eos_token_ids) if sp.structured is not None else (),
        seeded=sp.seed is not None,
    )


class NewRequestData(msgspec.Struct, frozen=True, kw_only=True):
    """Sent once when a request (re)enters the worker: sampling state and token history."""

    request_id: str
    prompt_token_ids: list[int]
    output_token_ids: list[int]  # non-empty when resuming after preemption
    sampling: WireSampling
    seed: int


class ScheduledEntry(msgspec.Struct, frozen=True, kw_only=True, array_like=True, gc=False):
    """What to compute for one request in one step.

    One is built per running request per step, so it is encoded as an array (both ends share this
    definition, so field names need not travel) and is not tracked by the garbage collector (it
    holds only strings, ints and containers of ints, which cannot form a reference cycle).

    ``token_ids`` are the known input tokens. When ``use_last_sampled`` is true the single input
    token is the worker's own last sampled token for this request (async scheduling), never a
    placeholder value. ``num_draft`` draft tokens from the worker's draft cache follow it.
    ``start_pos`` is the request's computed-token count at schedule time; ``rejected_seen`` is how
    many rejected draft positions the scheduler had reclaimed by then, so the worker can correct
    positions for rejections the scheduler had not yet seen. ``new_block_ids`` are the blocks appended
    to each cache group's table since the request's previous entry (all of them in its first entry
    after it (re)entered the worker): the worker keeps the tables, so a step message grows with what
    changed, not with running requests x blocks. ``num_propose`` is how many drafts the worker
    proposes for the request after this step (the speculative policy's decision for its next decode,
    which verifies at most that many; 0: none, so a drafter whose every depth costs a forward skips
    the request; -1: as many as the drafter and ``StepCommand.draft_depth`` allow). ``num_steps``
    above 1 makes a decode several (``num_scheduler_steps``): the worker runs up to that many
    forwards of the request one after another within this command, each on the token the one before
    sampled, and stops early at a token that ends the request or at an error (left to the next
    command to meet and report); positions it did not compute are given back like rejected drafts.
    """

    request_id: str
    token_ids: list[int]
    use_last_sampled: bool
    num_draft: int
    start_pos: int
    rejected_seen: int
    new_block_ids: dict[str, list[int]]
    sample: bool
    num_propose: int = -1
    num_steps: int = 1


class GrammarCompile(msgspec.Struct, frozen=True, kw_only=True, array_like=True):
    """A structured request's grammar, sent with the first command after the request is added, so
    the worker compiles it while the request waits (the scheduler admits it once the worker reports
    it compiled: see ``StepResult.grammars_ready``). ``eos`` is the request's ``grammar_eos``: the
    compile is the one its admission uses."""

    request_id: str
    spec: StructuredSpec
    eos: tuple[int, ...]


class StepCommand(msgspec.Struct, frozen=True, tag=True):
    """One step: requests entering the worker, what to compute, and requests to forget first.

    ``draft_depth`` caps the drafts the worker proposes per request after this step (the
    speculative policy's drafting depth); ``None`` leaves the drafter's configured depth.
    ``compile_grammars`` are the grammars of requests added since the previous command, to compile
    before they are scheduled; ``forget_grammars`` the structured requests that finished since (the
    worker drops their compile, and cancels it while no other request waits on it).
    ``arrivals_seen``: the arrivals the engine had taken when it scheduled the step (see
    :class:`~pypto_serving.executor.StepInterrupt`); its forwards after the first stop once more came.
    """

    step_id: int
    new_requests: list[NewRequestData]
    entries: list[ScheduledEntry]
    finished_ids: list[str]
    draft_depth: int | None = None
    compile_grammars: list[GrammarCompile] = []
    forget_grammars: list[str] = []
    arrivals_seen: int = 0


class StepResult(msgspec.Struct):
    """What one step produced, keyed by request id; ``error`` fails the whole step."""

    step_id: int
    sampled: dict[str, list[int]] = {}
    logprobs: dict[str, list[dict[int, float]]] = {}
    request_errors: dict[str, str] = {}
    # Prompt logprobs computed this step: (first prompt position, the entries of that position on).
    prompt_logprobs: dict[str, tuple[int, list[dict[int, float]]]] = {}
    error: str | None = None
    num_drafted: int = 0
    num_verify_steps: int = 0  # request-steps that verified at least one draft
    num_accepted_per_pos: list[int] = []
    execute_seconds: float = 0.0
    draft_seconds: float = 0.0  # the part of execute_seconds spent proposing next step's drafts
    num_forwards: int = 1  # forwards the worker ran for the command (several with ScheduledEntry.num_steps)
    # Requests whose grammar (StepCommand.compile_grammars) finished compiling, or failed to, since
    # the previous result: the scheduler admits them without any step waiting on the compile.
    grammars_ready: list[str] = []
    # Adapters (ReadLora keys) whose background read ended, well or not, since the previous result.
    loras_read: list[str] = []


# Worker lifecycle messages, private to the engine <-> worker pipe (see worker.py).


class InitCache(msgspec.Struct, frozen=True, tag=True):
    num_blocks: dict[str, int]


class InitDone(msgspec.Struct, frozen=True):
    ok: bool
    error: str | None = None


class Loaded(msgspec.Struct, frozen=True):
    info: ExecutorInfo | None
    error: str | None = None


class Shutdown(msgspec.Struct, frozen=True, tag=True):
    pass


class ProfileMemory(msgspec.Struct, frozen=True, tag=True):
    """Measure device memory and a forward of ``num_tokens`` prompt tokens (see memory.py)."""

    num_tokens: int


class MemoryProfile(msgspec.Struct, frozen=True, kw_only=True):
    """Device-wide total and in-use bytes after loading, and the peak bytes a profile step added."""

    ok: bool
    total_bytes: int = 0
    used_bytes: int = 0
    peak_bytes: int = 0
    error: str | None = None


class ReadLora(msgspec.Struct, frozen=True, tag=True):
    """Start reading a PEFT adapter in the background (``Executor.read_lora``) while steps run; not
    answered: a later :class:`StepResult` lists its key in ``loras_read`` once the read ended."""

    key: str
    path: str


class LoadLora(msgspec.Struct, frozen=True, tag=True):
    """Install the adapter read for ``key`` (read now if no :class:`ReadLora` came first) into a
    free slot between steps (``Executor.install_lora``); answered by an :class:`InitDone` whose
    ``error`` says why the adapter was refused."""

    key: str
    path: str
    slot: int


WorkerCommand = StepCommand | InitCache | ProfileMemory | ReadLora | LoadLora | Shutdown
