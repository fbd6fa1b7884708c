"""The executor contract: what an executor plugin implements and what it is given.

An :class:`Executor` lives in the worker process. The engine plans caches from the
:class:`ExecutorInfo` it reports (one :class:`CacheGroupSpec` per kind of paged state), and each
step hands it one flat :class:`BatchInput`. The step messages that cross the process boundary are in
:mod:`pypto_serving.messages`, the worker process in :mod:`pypto_serving.worker`.
"""

from __future__ import annotations

import abc
import ctypes
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from .request import LoopDraw

if TYPE_CHECKING:
    # Annotations only: the engine side (the KV-cache planner, the scheduler) reads CacheGroupSpec and
    # ExecutorInfo without loading torch.
    import torch

    from .sampler import DrawKernel
    from .spec_decode.sampled import DraftSampler

__all__ = ["BatchInput", "CacheGroupSpec", "Executor", "ExecutorInfo", "LoopDraw", "StepInterrupt"]


@dataclass(frozen=True, slots=True)
class CacheGroupSpec:
    """One kind of paged state, with its own block pool.

    :param name: the group's key in ``init_kv_cache``'s ``num_blocks`` and in ``BatchInput``'s tables.
    :param block_size: entries per block.
    :param bytes_per_block: device memory of one block over all layers; sizes the pool from ``kv_cache_memory``.
    :param tokens_per_entry: sequence tokens one entry covers: 1 for plain KV, the compression rate for compressed KV.
    :param prefix_caching: whether requests with a common prefix may share this group's blocks; the engine
        caches prefixes only when every group allows it.
    :param no_prefix_caching_reason: why ``prefix_caching`` is off, for people reading the executor's info.
    :param window_tokens: for sliding-window state: a query at position ``p`` reads only the entries
        of positions ``p - window_tokens + 1 .. p``. The engine then gives back the blocks wholly
        before the window of every position still to be computed, so a request holds O(window)
        blocks of this group, not O(sequence); their entries in the worker's tables go stale and
        must never be read. ``None``: every entry stays readable.
    :param hit_lookback_tokens: how many positions before a prefix hit at ``p`` the computation from
        ``p`` on reads in this group, so a hit needs only the cached blocks holding positions
        ``p - hit_lookback_tokens .. p - 1`` (keys still chain from the first block). ``None``: the
        window for a sliding-window group (``window_tokens - 1``), every earlier position for the
        others. ``0``: the executor rebuilds what it needs after a hit (the group needs no cached
        block and publishes none).
    :param slot_shift: the group keeps position ``i``'s entry at index ``i + slot_shift`` (tokens per
        entry 1), so its tables cover ``slot_shift`` entries past the request's tokens. A block then
        holds entries that are a function of the tokens before its end when an entry at ``i`` depends
        on the ``slot_shift`` tokens after ``i`` (an MTP depth's KV), so it is cached and hit like a
        plain block; the lookback and the window count entries, not positions.
    """

    name: str
    block_size: int
    bytes_per_block: int
    tokens_per_entry: int = 1
    prefix_caching: bool = True
    no_prefix_caching_reason: str = ""
    window_tokens: int | None = None
    hit_lookback_tokens: int | None = None
    slot_shift: int = 0

    @property
    def tokens_per_block(self) -> int:
        return self.block_size * self.tokens_per_entry

    @property
    def hit_lookback(self) -> int | None:
        """Positions before a prefix hit that the computation from the hit reads (None: all)."""
        if self.hit_lookback_tokens is not None:
            return self.hit_lookback_tokens
        return None if self.window_tokens is None else self.window_tokens - 1


@dataclass(slots=True)
class ExecutorInfo:
    """What an executor tells the engine after loading.

    :param cache_groups: the kinds of paged state it keeps, each with its own block pool.
    :param vocab_size: the width of the logits rows ``execute`` returns.
    :param max_model_len: the longest sequence (prompt and output) it can hold.
    :param eos_token_ids: tokens that end a request unless ``ignore_eos`` is set.
    :param architecture: the architecture it loaded, e.g. ``Qwen3ForCausalLM`` (informational only).
    :param supports_pipelining: it can run under the async (depth-2) strategy.
    :param uniform_batches: its kernels need each step all-prefill or all-decode.
    :param max_draft_tokens: drafting depth of its own drafter (e.g. MTP layers) per step (0: none).
    :param can_verify_drafts: its forward gives exact logits for a decode's ``1 + k`` query positions,
        so the core's own drafters (``speculative_config.method = "ngram"``) can speculate for it.
    :param prefill_barrier: a request's first decode waits for the result of its last prefill step.
    :param generation_defaults: the checkpoint's sampling defaults (from ``generation_config.json``).
    :param kv_cache_dtypes: the ``kv_cache_dtype`` settings it honours; the engine refuses any other.
    :param supports_lora: it applies LoRA adapters (``lora_modules``, ``enable_lora``: it reads
        ``lora_modules`` itself and implements :meth:`Executor.read_lora` and
        :meth:`Executor.install_lora`); the engine refuses LoRA settings otherwise, so a request
        naming an adapter never runs the base model silently.
    :param thread_count_invariant: its logits are bitwise the same whatever the number of CPU threads
        (tested), so a pinned CPU worker may compute on fewer cores beside a busy process without
        changing a token (``worker_shed_busy_cores = "auto"``).
    """

    cache_groups: list[CacheGroupSpec]
    vocab_size: int
    max_model_len: int
    eos_token_ids: list[int] = field(default_factory=list)
    architecture: str = ""
    supports_pipelining: bool = True
    uniform_batches: bool = False
    max_draft_tokens: int = 0
    can_verify_drafts: bool = False
    prefill_barrier: bool = False
    generation_defaults: dict[str, Any] = field(default_factory=dict)
    kv_cache_dtypes: tuple[str, ...] = ("auto",)
    supports_lora: bool = False
    thread_count_invariant: bool = False


class StepInterrupt:
    """Ends a command of several forwards (``num_scheduler_steps``) after its current forward when a
    request (or an abort) arrives meanwhile, so the arrival is scheduled one forward later instead of
    a command later.

    :attr:`word` counts the arrivals, in memory shared with the worker process (:meth:`shared`, handed
    to the process when it is spawned) or in this process's (an in-process worker): whoever feeds the
    engine from another thread or process counts each arrival after queuing it (:meth:`arrive`), and
    takes the count so far (:meth:`take`) before each read of that queue. Each
    command carries the count taken before it was scheduled (``StepCommand.arrivals_seen``); the
    worker's copy holds it in :attr:`seen` while the command runs, and the command is interrupted
    once the count has moved past it (:meth:`is_set`), read between forwards, native loops too. So a
    command scheduled before an arrival ends after its current forward even where it was already
    queued behind another (async scheduling), and one scheduled after it runs whole. A command
    always runs its first forward, so an interrupt costs forwards a command, never progress; the
    forwards it leaves are given back as those after a stop token are, and the tokens are the same
    (the forwards are the same, only split over more commands)."""

    __slots__ = ("seen", "word")

    def __init__(self, word: ctypes.c_int32 | None = None) -> None:
        self.word = ctypes.c_int32(0) if word is None else word
        """The arrivals so far (wrapping at 32 bits; only equality is read)."""
        self.seen = 0
        """The count the command running (worker side) or the next command (engine side) was scheduled after."""

    @classmethod
    def shared(cls, context: Any) -> StepInterrupt:
        """A count in shared memory from the multiprocessing ``context`` that spawns the worker."""
        return cls(context.RawValue(ctypes.c_int32, 0))

    def arrive(self) -> None:
        """One arrival: every command scheduled before it ends after its current forward (thread-safe)."""
        self.word.value += 1

    def take(self) -> None:
        """Take the arrivals so far: commands scheduled from now on run whole until the next one."""
        self.seen = self.word.value

    def is_set(self) -> bool:
        """Whether a request arrived after the command's scheduling (after :meth:`take`, engine side)."""
        return self.word.value != self.seen


@dataclass(slots=True, kw_only=True)
class BatchInput:
    """One step's flat token batch, placed by the runner on :attr:`Executor.device`.

    ``T`` tokens of ``R`` requests laid end to end; request ``r`` owns rows
    ``query_start_loc[r]:query_start_loc[r+1]`` and, after this step, has ``seq_lens[r]`` tokens in
    its cache. ``logits_indices`` are the rows whose logits the runner needs, grouped per request in
    order: a request asking for prompt logprobs has its scored prompt rows first, then its
    ``num_logits`` sampled rows.

    :param request_ids: the ``R`` request ids, in batch order (host list).
    :param input_ids: ``[T]`` int64 token ids, on ``device``.
    :param positions: ``[T]`` int64 position of each token in its sequence, on ``device``.
    :param query_start_loc: ``[R + 1]`` int32 first row of each request, then ``T``, on ``device``.
    :param seq_lens: ``[R]`` int32 cached tokens of each request after this step, on ``device``.
    :param block_tables: per cache group, ``[R, max_blocks]`` int32 block ids (padded with 0), on ``device``.
    :param slot_mapping: per cache group whose entries are single tokens, ``[T]`` int64 cache slot of
        each token (of its entry ``position + slot_shift`` in a shifted group), on ``device``.
    :param logits_indices: int64 rows to return logits for, on ``device``: ``sum(num_logits)`` of
        them plus the prompt rows of requests asking for prompt logprobs. An executor that returns
        the sampled rows only (``sum(num_logits)`` of them, in order) fails just those requests.
    :param num_logits: logits rows per request: 0, 1 or 1 + drafts (host list).
    :param query_start_loc_host: ``query_start_loc`` as a host list, so per-request loops and shapes
        need no read of the device tensor (a host sync on an accelerator).
    :param seq_lens_host: ``seq_lens`` as a host list, for the same reason.
    :param input_ids_host: ``input_ids`` as a host list, for executors that keep per-request token
        state on the host (e.g. drafting bookkeeping).
    :param draft_depth: the most drafts per request that :meth:`Executor.propose_drafts` should make
        after this step (the speculative policy's drafting depth, so a drafter whose every depth
        costs a forward can skip the depths that do not pay); ``None``: the configured depth.
    :param num_drafts: per request in batch order, the most drafts to propose for it after this step
        (``ScheduledEntry.num_propose``: 0 for a request whose next decode verifies none, so a drafter
        whose every depth costs a forward leaves it out; -1: up to ``draft_depth``); ``None``: up to
        ``draft_depth`` for every request.
    :param loras: per request in batch order, its LoRA adapter's key (an adapter of ``lora_modules``:
        its name; one loaded at run time: the key of :meth:`Executor.install_lora`; None: the base model);
        ``None`` when no request of the step has one (host list).
    :param greedy_maxima: the sampler takes the argmax of some row's logits as they come this step
        (a greedy request): an executor whose output projection can take each logits row's maximum
        and its index as it writes the logits may, and return them from
        :meth:`Executor.logits_maxima` (saving the sampler a pass over the logits).
    :param maxima_only: besides ``greedy_maxima``, the runner reads nothing of this step's logits but
        their maxima (every logits row greedy over the logits as they come: no logprobs, penalties,
        bans, logit bias, grammar or drafts to verify). An executor that returns the maxima from
        :meth:`Executor.logits_maxima` may then return logits ``[N, 0]``, writing none (the stores of a
        64-row step's float32 logits are megabytes).
    :param interrupt: set on the batch of :meth:`Executor.greedy_steps` where the engine can end a
        command early: the loop ends after any forward once it is set (see :class:`StepInterrupt`).
    :param prompt_rows: per request in batch order, how many of its first rows are prompt tokens (all
        of a prefill chunk's, none of a decode's and its drafts'; a preempted request's recomputation
        its prompt's part), host list: an executor whose attention kernels sum in other orders for
        long and short runs attends prompt tokens with one and the rest with the other whatever the
        run's length, so a request's results do not depend on how the scheduler cut its prompt
        among other requests' rows. ``None``: not given (the executor decides by run length).
    """

    request_ids: list[str]
    input_ids: torch.Tensor
    positions: torch.Tensor
    query_start_loc: torch.Tensor
    seq_lens: torch.Tensor
    block_tables: dict[str, torch.Tensor]
    slot_mapping: dict[str, torch.Tensor]
    logits_indices: torch.Tensor
    num_logits: list[int]
    query_start_loc_host: list[int]
    seq_lens_host: list[int]
    input_ids_host: list[int]
    draft_depth: int | None = None
    num_drafts: list[int] | None = None
    loras: list[str | None] | None = None
    greedy_maxima: bool = False
    maxima_only: bool = False
    interrupt: StepInterrupt | None = None
    prompt_rows: list[int] | None = None


class Executor(abc.ABC):
    """A model runner plugged in by an executor plugin. Lives in the worker process.

    Lifecycle: ``load()`` -> ``init_kv_cache()`` -> ``execute()`` per step -> ``shutdown()``.
    """

    device: torch.device
    """Where the model runs, set by :meth:`load`. The runner places every :class:`BatchInput`
    tensor there, so ``execute`` uses them as they are."""

    @abc.abstractmethod
    def load(self) -> ExecutorInfo:
        """Load weights and set :attr:`device`.

        :return: what the engine needs to plan caches and schedule.
        """

    @abc.abstractmethod
    def init_kv_cache(self, num_blocks: dict[str, int]) -> None:
        """Allocate the paged cache tensors on :attr:`device`.

        :param num_blocks: blocks to allocate per cache group name.
        """

    @abc.abstractmethod
    def execute(self, batch: BatchInput) -> torch.Tensor:
        """Run one forward over the flat batch, writing KV into the paged caches.

        :param batch: the step's tokens, already on :attr:`device`.
        :return: float logits ``[len(batch.logits_indices), vocab]`` for the requested rows; where
            ``batch.maxima_only`` and :meth:`logits_maxima` returns the rows' maxima, ``[N, 0]`` may
            stand for logits nobody reads.
        """

    def logits_maxima(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        """Each row's maximum and its index, of the logits the last :meth:`execute` returned, where it
        took them as it wrote the logits (asked by ``BatchInput.greedy_maxima``); executors that do not
        keep this default and the sampler takes them itself.

        :return: ``(amax, argmax)`` of the logits' rows, exactly: float32 ``[N]`` maxima and int64
            ``[N]`` indices (a row's maximum at its lowest index, or its first NaN where it has one), on
            :attr:`device`; or ``None``.
        """
        return None

    def greedy_steps(self, batch: BatchInput, steps: int, stop_ids: list[frozenset[int]]) -> list[list[int]] | None:
        """Up to ``steps`` one-token forwards of ``batch``'s requests back to back, each row's input after
        the first its argmax of the forward before: a multi-step decode (``num_scheduler_steps``), or a
        lone request's decode of one forward or more, whose every row is greedy over the logits as they
        come (no logprobs, penalties, bans, logit bias, grammar or drafts), run without the runner's
        work between forwards. The tokens must be those
        :meth:`execute` and :meth:`logits_maxima` give forward by forward, bit for bit; executors that
        cannot run such a loop keep this default and the runner runs the forwards one by one.

        :param batch: the first forward: one token a request (its last sampled one, or the token the
            scheduler named for the command's first forward) at its position,
            with ``maxima_only`` set; each request's blocks cover its next ``steps`` positions, so
            forward ``s`` writes position ``positions[r] + s`` into the slot its block table gives.
        :param steps: the most forwards to run (at least 1).
        :param stop_ids: per request in batch order, the tokens that end it.
        :return: the tokens of each forward run, ``[k][R]``: ``k == steps`` unless the run stopped after
            the forward where some request's token is one of its ``stop_ids``, after any forward once
            ``batch.interrupt`` is set (an executor that does not read it runs on: the engine's
            arrivals then wait for the loop), or before one where
            some row's maximum logit is not finite (NaN or infinite: that forward's tokens are left
            out, ``k`` may be 0, and the runner computes the position again); or ``None`` where this
            executor does not take the run (before writing anything).
        """
        return None

    def sampled_steps(
        self, batch: BatchInput, steps: int, stop_ids: list[frozenset[int]], draws: list[LoopDraw | None]
    ) -> list[list[int]] | None:
        """:meth:`greedy_steps` where some request samples: each forward's token of request ``r`` is
        drawn by ``draws[r]`` (None: its argmax) from the logits :meth:`execute` gives for that forward,
        by the sampler's rule and with the uniform the sampler would use for that output, so the tokens
        are those of the forwards one by one through the sampler (with :meth:`draw_kernel`'s draw where
        it gives one), bit for bit. The request samples nothing else: no logprobs, penalties, logit
        bias, bans, grammar or drafts. Executors that cannot keep this default (the runner runs the
        forwards one by one).

        :param draws: per request in batch order, its draw, or None for a greedy one.
        :return: as :meth:`greedy_steps`.
        """
        return None

    def draw_kernel(self) -> DrawKernel | None:
        """A kernel of this executor's that draws the sampled rows of its logits by the sampler's rule
        (:data:`pypto_serving.sampler.DrawKernel`: the kept tokens' cumulative weight in id order),
        asked once after :meth:`load`; executors without one keep this default and the sampler's
        torch ops draw. Its tokens may differ from the torch draw's only where a rounding moves a
        row's uniform across a boundary between two tokens' cumulative weights, and a row's token
        must depend on that row alone (seeded requests sample the same tokens in any batch).

        :return: the kernel, or ``None``.
        """
        return None

    def propose_drafts(self, batch: BatchInput, accepted: list[list[int]]) -> list[list[int]]:
        """Draft tokens for each request's next step. Executors without drafting keep this default.

        :param batch: the batch :meth:`execute` just ran.
        :param accepted: per request in batch order, the tokens committed this step (empty where the
            request sampled nothing).
        :return: per request in batch order, its draft tokens (``[]`` for none).
        """
        return [[] for _ in batch.request_ids]

    def propose_sampled_drafts(
        self, batch: BatchInput, accepted: list[list[int]], sampler: DraftSampler
    ) -> list[list[int]]:
        """Drafts as :meth:`propose_drafts`, each chosen by ``sampler.pick(logits, batch_rows)`` from
        the drafter's logits (``batch_rows``: the batch row each logits row drafts for, in drafting
        order per request). The sampler draws the drafts of sampled requests from their processed
        softmax and keeps those probabilities, so the runner verifies them by rejection sampling;
        other rows get the argmax. The default ignores ``sampler``: drafts from
        :meth:`propose_drafts` count as point masses and are verified by sample-and-compare.
        """
        return self.propose_drafts(batch, accepted)

    def kv_cache_blocks(self) -> dict[str, list[torch.Tensor]] | None:
        """The cache tensors of each group, each indexed by block id on its first dimension, for a
        KV connector to read and write blocks (disaggregated serving). ``None`` (the default): the
        executor's KV cannot be moved, e.g. it keeps per-request state outside the paged blocks."""
        return None

    def read_lora(self, key: str, path: str) -> Any:
        """Read and check the PEFT adapter directory ``path`` for :meth:`install_lora`. Runs in a
        background thread of the worker while steps run, so it must not touch what a step uses
        (the model's weights, caches or per-request state). Executors without LoRA keep this default.

        :raises ValueError: the adapter cannot be served (the message says why).
        """
        raise ValueError(f"the {type(self).__name__} executor does not serve LoRA adapters")

    def install_lora(self, key: str, adapter: Any, slot: int) -> None:
        """Put an adapter :meth:`read_lora` returned into adapter slot ``slot`` (1 .. ``max_loras``,
        one the engine has freed), replacing what the slot held; requests then name it by ``key``
        in :attr:`BatchInput.loras`. Called between steps: the steps wait for it, so it only copies."""
        raise ValueError(f"the {type(self).__name__} executor does not serve LoRA adapters")

    def release(self, request_ids: list[str]) -> None:  # noqa: B027 - optional hook
        """Forget per-request state.

        :param request_ids: requests that finished, were aborted or were preempted.
        """

    def shutdown(self) -> None:  # noqa: B027 - optional hook
        """Free device memory."""
