"""Streamed responses: Server-Sent Events over the merged outputs of a request's prompts, with
add-time errors raised before the first byte and cumulative outputs turned into OpenAI chunks."""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import AsyncGenerator, AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

from fastapi.responses import StreamingResponse

from ..engine import EngineDeadError
from ..parsers import OutputParser
from ..request import CompletionOutput, RequestOutput, SamplingParams
from ..structured import grammar_failed
from .async_llm import EngineFailure
from .openai_requests import _Ctx, _engine_error, _Prompt, _request_ids, _shown_model
from .protocol import ChatCompletionRequest, CompletionRequest, error_body
from .responses import (
    _chat_finish_reason,
    _chat_logprobs,
    _completion_logprobs,
    _echo_rows,
    _failure_message,
    _prompt_text,
    _tool_call,
    _usage,
)


@dataclass(slots=True)
class _ChoiceState:
    """What one streamed choice has sent so far (outputs are cumulative snapshots)."""

    text_sent: int = 0
    tokens_sent: int = 0
    started: bool = False
    finished: bool = False
    parser: OutputParser | None = None  # a chat choice's reasoning / tool-call parser
    num_calls: int = 0  # tool calls streamed so far
    echo_len: int = 0  # characters of the echoed prompt before the choice's text (text offsets count them)


def _sse(gen: AsyncIterator[str]) -> StreamingResponse:
    return StreamingResponse(gen, media_type="text/event-stream", headers={"cache-control": "no-cache"})


def _event(data: dict[str, Any]) -> str:
    return f"data: {json.dumps(data)}\n\n"


_DONE = "data: [DONE]\n\n"


async def _merged(
    ctx: _Ctx, rid: str, prompts: list[_Prompt], params: list[SamplingParams]
) -> AsyncGenerator[tuple[int, RequestOutput]]:
    """Outputs of all prompts' requests as they come, tagged with the prompt index. Adds happen
    before the first yield so validation errors surface before any byte is sent."""
    streams = []
    ids = _request_ids(rid, len(prompts))
    added: list[str] = []
    try:
        for i, p, sp in zip(ids, prompts, params):
            streams.append(await ctx.llm.add_request(i, p.ids, sp))
            added.append(i)
    except BaseException:
        for i in added:
            ctx.llm.abort(i)
        raise
    merged: asyncio.Queue[tuple[int, RequestOutput | EngineFailure]] = asyncio.Queue()

    async def pump(idx: int) -> None:
        while True:
            item = await streams[idx].queue.get()
            await merged.put((idx, item))
            if isinstance(item, EngineFailure) or item.finished:
                return

    pumps = [asyncio.ensure_future(pump(k)) for k in range(len(streams))]
    done: set[int] = set()
    try:
        while len(done) < len(streams):
            idx, item = await merged.get()
            if isinstance(item, EngineFailure):
                raise item
            if item.finished:
                done.add(idx)
            yield idx, item
    finally:
        for t in pumps:
            t.cancel()
        for k, rid_k in enumerate(ids):
            if k not in done:
                ctx.llm.abort(rid_k)  # disconnect or failure: free the blocks now


async def _prepare(gen: AsyncGenerator[tuple[int, RequestOutput]]) -> tuple[int, RequestOutput] | None:
    """Pull the first item before streaming starts so add-time errors become plain HTTP errors."""
    try:
        return await gen.__anext__()
    except StopAsyncIteration:
        return None
    except (ValueError, EngineDeadError, EngineFailure) as e:
        raise _engine_error(e) from None


def _hold_back(params: SamplingParams) -> int:
    # A stop string may start in text we would already have streamed; keep its length - 1 back.
    return max((len(s) for s in params.stop), default=1) - 1


def _error_event(message: str) -> str:
    return _event(error_body(message, "server_error", None, "generation_failed"))


async def _with_first(
    first: tuple[int, RequestOutput] | None, gen: AsyncGenerator[tuple[int, RequestOutput]]
) -> AsyncGenerator[tuple[int, RequestOutput]]:
    # Close the source explicitly: a disconnect closes only the outermost generator.
    async with contextlib.aclosing(gen):
        if first is not None:
            yield first
            async for item in gen:
                yield item


async def _start_stream(ctx: _Ctx, rid: str, prompts: list[_Prompt], params: list[SamplingParams]) -> _StreamRunner:
    """Add the prompts' requests and wait for the first output (so add-time errors become plain HTTP
    errors), then hand the outputs to a runner whose ``completion``/``chat`` yields the SSE chunks."""
    source = _merged(ctx, rid, prompts, params)
    first = await _prepare(source)
    return _StreamRunner(ctx, rid, prompts, params, _with_first(first, source))


class _StreamRunner:
    """Turns cumulative outputs into OpenAI SSE chunks (text deltas, logprobs, finish, usage)."""

    def __init__(
        self,
        ctx: _Ctx,
        rid: str,
        prompts: list[_Prompt],
        params: list[SamplingParams],
        source: AsyncGenerator[tuple[int, RequestOutput]],
    ) -> None:
        self.ctx, self.rid, self.prompts, self.params, self.source = ctx, rid, prompts, params, source
        self.created = int(time.time())
        self.finals: dict[int, RequestOutput] = {}
        self.latest: dict[int, RequestOutput] = {}  # each prompt's last output (its prompt logprobs)
        self.kv_due: dict[str, Any] | None = None  # a prefill's kv_transfer_params, not streamed yet
        self.kv_sent = False

    async def _items(self) -> AsyncGenerator[tuple[int, CompletionOutput, _ChoiceState, int, int, bool]]:
        """(prompt index, choice, state, token start, token end, finished now) for every change."""
        states: dict[tuple[int, int], _ChoiceState] = {}
        async with contextlib.aclosing(self.source):
            async for pi, out in self.source:
                self.latest[pi] = out
                if out.kv_transfer_params is not None and not self.kv_sent:  # one prompt: checked on add
                    self.kv_due, self.kv_sent = out.kv_transfer_params, True
                if out.finished:
                    self.finals[pi] = out
                for c in out.outputs:
                    st = states.setdefault((pi, c.index), _ChoiceState())
                    if st.finished:
                        continue
                    done = c.finish_reason is not None
                    yield pi, c, st, st.tokens_sent, len(c.token_ids), done
                    st.tokens_sent = len(c.token_ids)
                    st.finished = done

    def _delta_text(self, pi: int, c: CompletionOutput, st: _ChoiceState, done: bool) -> str:
        upto = len(c.text) if done else max(st.text_sent, len(c.text) - _hold_back(self.params[pi]))
        delta = c.text[st.text_sent : upto]
        st.text_sent = max(st.text_sent, upto)
        return delta

    def _failed_event(self, c: CompletionOutput) -> str:
        if grammar_failed(c.error):  # the client's grammar, as a 400 says
            return _event(error_body(_failure_message(self.ctx, c), "invalid_request_error", None, "invalid_grammar"))
        return _error_event(_failure_message(self.ctx, c))

    def _kv_chunk(self, obj: str) -> str:
        """A prefill's ``kv_transfer_params`` as soon as they are known: with ``stream_kv`` before the
        prefill is computed, so a decode engine can pull while it runs (else with the last output)."""
        params, self.kv_due = self.kv_due, None
        chunk = {"id": self.rid, "object": obj, "created": self.created, "choices": [], "kv_transfer_params": params}
        return _event({**chunk, "model": _shown_model(self.ctx, self.params[0].lora)})

    def _usage_chunk(self, obj: str) -> str:
        outs = [self.finals[i] for i in sorted(self.finals)]
        return _event(
            {
                "id": self.rid,
                "object": obj,
                "created": self.created,
                "model": _shown_model(self.ctx, self.params[0].lora),
                "choices": [],
                "usage": _usage(self.prompts, outs),
            }
        )

    async def completion(self, req: CompletionRequest) -> AsyncIterator[str]:
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        try:
            async with contextlib.aclosing(self._items()) as items:
                async for pi, c, st, start, end, done in items:
                    if self.kv_due is not None:
                        yield self._kv_chunk("text_completion")
                    if c.finish_reason == "error":
                        yield self._failed_event(c)
                        yield _DONE
                        return
                    prefix = ""
                    echo = None
                    if not st.started:
                        st.started = True
                        if req.echo:  # the first output follows the prompt: its logprobs are complete
                            prefix = _prompt_text(self.ctx, self.prompts[pi])
                            ids, lps = self.prompts[pi].ids, self.latest[pi].prompt_logprobs
                            echo = _echo_rows(self.ctx, ids, lps, req.logprobs or 0)
                            st.echo_len = len(prefix)
                    text = prefix + self._delta_text(pi, c, st, done)
                    if not text and not done and echo is None and (c.logprobs is None or start == end):
                        continue
                    span = (start, end, st.echo_len + st.text_sent - len(text))
                    choice = {
                        "index": pi * req.n + c.index,
                        "text": text,
                        "logprobs": _completion_logprobs(self.ctx, c, span, echo),
                        "finish_reason": c.finish_reason,
                        "stop_reason": c.stop_reason if done else None,
                    }
                    yield _event(
                        {
                            "id": self.rid,
                            "object": "text_completion",
                            "created": self.created,
                            "model": _shown_model(self.ctx, self.params[0].lora),
                            "choices": [choice],
                            **({"usage": None} if include_usage else {}),
                        }
                    )
        except (EngineFailure, EngineDeadError, ValueError) as e:
            yield _error_event(f"generation failed: {e}")
            yield _DONE
            return
        if include_usage:
            yield self._usage_chunk("text_completion")
        yield _DONE

    def _chat_chunk(self, choice: dict[str, Any], include_usage: bool) -> str:
        return _event(
            {
                "id": self.rid,
                "object": "chat.completion.chunk",
                "created": self.created,
                "model": _shown_model(self.ctx, self.params[0].lora),
                "choices": [choice],
                **({"usage": None} if include_usage else {}),
            }
        )

    async def chat(
        self, req: ChatCompletionRequest, parsers: Callable[[], OutputParser] | None = None
    ) -> AsyncIterator[str]:
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        top_n = req.top_logprobs or 0
        try:
            async with contextlib.aclosing(self._items()) as items:
                async for _pi, c, st, start, end, done in items:
                    if self.kv_due is not None:
                        yield self._kv_chunk("chat.completion.chunk")
                    if c.finish_reason == "error":
                        yield self._failed_event(c)
                        yield _DONE
                        return
                    if not st.started:
                        st.started = True
                        st.parser = parsers() if parsers is not None else None
                        role = {"role": "assistant", "content": ""}
                        yield self._chat_chunk(
                            {"index": c.index, "delta": role, "logprobs": None, "finish_reason": None}, include_usage
                        )
                    text = self._delta_text(0, c, st, done)
                    for choice in self._chat_choices(c, st, text, (start, end, top_n), done):
                        yield self._chat_chunk(choice, include_usage)
        except (EngineFailure, EngineDeadError, ValueError) as e:
            yield _error_event(f"generation failed: {e}")
            yield _DONE
            return
        if include_usage:
            yield self._usage_chunk("chat.completion.chunk")
        yield _DONE

    def _chat_choices(
        self, c: CompletionOutput, st: _ChoiceState, text: str, span: tuple[int, int, int], done: bool
    ) -> list[dict[str, Any]]:
        """The choice objects of one output change: one per delta (text, reasoning, each tool call's
        header and arguments); the first carries the logprobs, the last the finish reason."""
        start, end, top_n = span
        deltas = _chat_deltas(st, text, done)
        if not deltas:
            if not done and (c.logprobs is None or start == end):
                return []
            deltas = [{}]
        finish = _chat_finish_reason(c, st.num_calls > 0) if done else c.finish_reason
        choices: list[dict[str, Any]] = []
        for i, delta in enumerate(deltas):
            last = i == len(deltas) - 1
            choices.append(
                {
                    "index": c.index,
                    "delta": delta,
                    "logprobs": _chat_logprobs(self.ctx, c, start, end, top_n) if i == 0 else None,
                    "finish_reason": finish if last else None,
                    **({"stop_reason": c.stop_reason} if done and last else {}),
                }
            )
        return choices


def _chat_deltas(st: _ChoiceState, text: str, done: bool) -> list[dict[str, Any]]:
    """The OpenAI deltas of a choice's new ``text``: plain content, or what its parser released. A tool
    call goes out as two deltas: its id, type and name (empty arguments), then its arguments."""
    if st.parser is None:
        return [{"content": text}] if text else []
    parsed = st.parser.feed(text)
    if done:
        parsed += st.parser.finish()
    deltas: list[dict[str, Any]] = []
    if parsed.reasoning:
        deltas.append({"reasoning_content": parsed.reasoning})
    if parsed.content:
        deltas.append({"content": parsed.content})
    for call in parsed.tool_calls:
        head = _tool_call(call)
        head["function"]["arguments"] = ""
        deltas.append({"tool_calls": [{"index": st.num_calls, **head}]})
        deltas.append({"tool_calls": [{"index": st.num_calls, "function": {"arguments": call.arguments}}]})
        st.num_calls += 1
    return deltas
