"""DeepSeek-V4's chat encoding: the prompt format the release describes in its ``encoding/`` folder
(it ships no Jinja chat template), written here from that description.

A conversation renders as ``<｜begin▁of▁sentence｜>`` then each message:

- ``system``: its text, then the tool section when the request has tools;
- ``user`` / ``developer``: ``<｜User｜>`` and the text; consecutive user turns and ``tool`` results
  fold into one user turn (V4 has no tool role), parts joined by a blank line, each tool result as
  ``<tool_result>...</tool_result>`` in the order of the calls that asked for them;
- after the last user turn (and before each assistant reply) ``<｜Assistant｜>`` then ``<think>`` in
  thinking mode or ``</think>`` in chat mode;
- ``assistant``: reasoning (thinking mode, kept for the turns after the last user turn unless
  ``drop_thinking`` is off or the request has tools) then ``</think>``, the answer, its calls as a
  DSML block (``string="true"`` values raw, others JSON) and ``<｜end▁of▁sentence｜>``.

The strings below are the format itself (the model was trained on them), so they are kept exact."""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

__all__ = ["DeepSeekV4ChatEncoder", "encode_messages"]

BOS = "<｜begin▁of▁sentence｜>"
EOS = "<｜end▁of▁sentence｜>"
USER = "<｜User｜>"
ASSISTANT = "<｜Assistant｜>"
THINK_START = "<think>"
THINK_END = "</think>"
DSML = "｜DSML｜"  # the bars are U+FF5C FULLWIDTH VERTICAL LINE, as in the tokenizer's special tokens

# In thinking mode at reasoning effort "max", this opens the conversation (the release's text).
EFFORT_MAX_PREFIX = (
    "Reasoning Effort: Absolute maximum with no shortcuts permitted.\n"
    "You MUST be very thorough in your thinking and comprehensively decompose the problem to resolve the "
    "root cause, rigorously stress-testing your logic against all potential paths, edge cases, and "
    "adversarial scenarios.\n"
    "Explicitly write out your entire deliberation process, documenting every intermediate step, considered "
    "alternative, and rejected hypothesis to ensure absolutely no assumption is left unchecked.\n\n"
)
REASONING_EFFORTS = (None, "high", "max")

# The tool section a system (or developer) turn carries: how to call, then one JSON schema a line.
TOOLS_SECTION = (
    "## Tools\n\n"
    "You have access to a set of tools to help answer the user's question. You can invoke tools by writing a "
    f'"<{DSML}tool_calls>" block like the following:\n\n'
    f"<{DSML}tool_calls>\n"
    f'<{DSML}invoke name="$TOOL_NAME">\n'
    f'<{DSML}parameter name="$PARAMETER_NAME" string="true|false">$PARAMETER_VALUE</{DSML}parameter>\n'
    "...\n"
    f"</{DSML}invoke>\n"
    f'<{DSML}invoke name="$TOOL_NAME2">\n'
    "...\n"
    f"</{DSML}invoke>\n"
    f"</{DSML}tool_calls>\n\n"
    'String parameters should be specified as is and set `string="true"`. For all other types (numbers, '
    'booleans, arrays, objects), pass the value in JSON format and set `string="false"`.\n\n'
    f"If thinking_mode is enabled (triggered by {THINK_START}), you MUST output your complete reasoning inside "
    f"{THINK_START}...{THINK_END} BEFORE any tool calls or final response.\n\n"
    f"Otherwise, output directly after {THINK_END} with tool calls or final response.\n\n"
    "### Available Tool Schemas\n\n"
    "{schemas}\n\n"
    "You MUST strictly follow the above defined tool name and parameter schemas to invoke tool calls.\n"
)

Message = dict[str, Any]


def _json(value: Any) -> str:
    return json.dumps(value, ensure_ascii=False)


def _text(content: Any) -> str:
    """A message's content as text: OpenAI content parts are joined, only their text kept."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(str(p.get("text", "")) if isinstance(p, Mapping) else str(p) for p in content)
    return str(content)


def tools_section(tools: list[Mapping[str, Any]]) -> str:
    schemas = "\n".join(_json(t.get("function", t)) for t in tools)
    return TOOLS_SECTION.replace("{schemas}", schemas)


def _arguments(arguments: Any) -> dict[str, Any]:
    """A call's arguments as a dict: OpenAI sends JSON text, the server hands templates a dict; text
    that is not a JSON object travels whole as one ``arguments`` parameter, as the release does."""
    if isinstance(arguments, Mapping):
        return dict(arguments)
    try:
        decoded = json.loads(arguments)
    except (TypeError, ValueError):
        return {"arguments": arguments}
    return decoded if isinstance(decoded, dict) else {"arguments": arguments}


def dsml_calls(tool_calls: list[Mapping[str, Any]]) -> str:
    """An assistant turn's calls as one DSML block."""
    invokes = []
    for call in tool_calls:
        function = call.get("function", call)
        params = [
            f'<{DSML}parameter name="{key}" string="{"true" if isinstance(value, str) else "false"}">'
            f"{value if isinstance(value, str) else _json(value)}</{DSML}parameter>"
            for key, value in _arguments(function.get("arguments", {})).items()
        ]
        invokes.append(f'<{DSML}invoke name="{function.get("name")}">\n' + "\n".join(params) + f"\n</{DSML}invoke>")
    return f"<{DSML}tool_calls>\n" + "\n".join(invokes) + f"\n</{DSML}tool_calls>"


def _fold_user_turns(messages: list[Message]) -> list[Message]:
    """``tool`` results and consecutive user turns become one user turn of parts (V4 has no tool role)."""
    out: list[Message] = []
    for msg in messages:
        role = msg.get("role")
        if role == "tool":
            part: tuple[str, str, str] = ("tool", str(msg.get("tool_call_id") or ""), _text(msg.get("content")))
        elif role == "user":
            part = ("text", "", _text(msg.get("content")))
        else:
            out.append(dict(msg))
            continue
        if out and out[-1].get("role") == "user" and "parts" in out[-1]:
            out[-1]["parts"].append(part)
        else:
            out.append({"role": "user", "parts": [part]})
    return out


def _order_tool_results(messages: list[Message]) -> None:
    """Each user turn's tool results in the order of the calls of the assistant turn before it."""
    order: dict[str, int] = {}
    for msg in messages:
        if msg.get("role") == "assistant" and msg.get("tool_calls"):
            order = {str(c["id"]): i for i, c in enumerate(msg["tool_calls"]) if c.get("id")}
        elif msg.get("role") == "user" and order:
            results = sorted((p for p in msg["parts"] if p[0] == "tool"), key=lambda p: order.get(p[1], 0))
            it = iter(results)
            msg["parts"] = [next(it) if p[0] == "tool" else p for p in msg["parts"]]


def _last_user(messages: list[Message]) -> int:
    return max((i for i, m in enumerate(messages) if m.get("role") in ("user", "developer")), default=-1)


def _drop_old_thinking(messages: list[Message]) -> list[Message]:
    """Before the last user turn: assistant turns lose their reasoning, developer turns go."""
    last = _last_user(messages)
    out = []
    for i, msg in enumerate(messages):
        if i >= last or msg.get("role") not in ("assistant", "developer"):
            out.append(msg)
        elif msg.get("role") == "assistant":
            out.append({k: v for k, v in msg.items() if k != "reasoning_content"})
    return out


def _user_text(msg: Message) -> str:
    parts = msg.get("parts")
    if parts is None:  # a developer turn
        return _text(msg.get("content"))
    return "\n\n".join(f"<tool_result>{text}</tool_result>" if kind == "tool" else text for kind, _, text in parts)


def _render_assistant(msg: Message, keep_reasoning: bool, thinking: bool) -> str:
    reasoning = (_text(msg.get("reasoning_content")) + THINK_END) if thinking and keep_reasoning else ""
    calls = "\n\n" + dsml_calls(msg["tool_calls"]) if msg.get("tool_calls") else ""
    return reasoning + _text(msg.get("content")) + calls + ("" if msg.get("wo_eos") else EOS)


def _render(i: int, messages: list[Message], *, thinking: bool, drop: bool, generation_prompt: bool) -> str:
    """Message ``i`` and, after a user turn that an assistant turn follows (or that ends the prompt
    with a generation prompt), the assistant prefix."""
    msg, last_user = messages[i], _last_user(messages)
    role = msg.get("role")
    tools = msg.get("tools") or []
    extra = "\n\n" + tools_section(tools) if tools else ""
    if role == "system":
        text = _text(msg.get("content")) + extra
    elif role in ("user", "developer"):
        text = USER + _user_text(msg) + extra
    elif role == "assistant":
        return _render_assistant(msg, keep_reasoning=not drop or i > last_user, thinking=thinking)
    else:
        raise ValueError(f"DeepSeek-V4's chat encoding has no role {role!r} (system, user, developer, assistant, tool)")
    following = messages[i + 1].get("role") if i + 1 < len(messages) else None
    if role == "system" or following not in ("assistant", None) or (following is None and not generation_prompt):
        return text
    think = thinking and (not drop or i >= last_user)
    return text + ASSISTANT + (THINK_START if think else THINK_END)


def encode_messages(
    messages: Sequence[Mapping[str, Any]],
    *,
    thinking: bool = False,
    tools: Sequence[Mapping[str, Any]] | None = None,
    drop_thinking: bool = True,
    reasoning_effort: str | None = None,
    add_generation_prompt: bool = True,
    continue_final_message: bool = False,
) -> str:
    """The prompt of a conversation (OpenAI-shaped messages) in thinking or chat mode.

    ``tools`` join the first message when it is a system turn, else an empty system turn put first.
    ``continue_final_message`` leaves a final assistant turn open (no end-of-sentence token)."""
    if reasoning_effort not in REASONING_EFFORTS:
        raise ValueError(
            f"reasoning_effort {reasoning_effort!r} is not one of {', '.join(map(str, REASONING_EFFORTS))}"
        )
    msgs = [dict(m) for m in messages]
    if tools:
        if not msgs or msgs[0].get("role") != "system":
            msgs.insert(0, {"role": "system", "content": ""})
        msgs[0]["tools"] = list(tools)
    if continue_final_message:
        if not msgs or msgs[-1].get("role") != "assistant":
            raise ValueError("continue_final_message needs a final assistant message")
        msgs[-1]["wo_eos"] = True
    msgs = _fold_user_turns(msgs)
    _order_tool_results(msgs)
    drop = drop_thinking and not any(m.get("tools") for m in msgs)
    if thinking and drop:
        msgs = _drop_old_thinking(msgs)
    prompt = BOS + (EFFORT_MAX_PREFIX if thinking and reasoning_effort == "max" else "")
    for i in range(len(msgs)):
        prompt += _render(i, msgs, thinking=thinking, drop=drop, generation_prompt=add_generation_prompt)
    return prompt


class DeepSeekV4ChatEncoder:
    """The tokenizer's chat format for a DeepSeek-V4 checkpoint without a chat template. It takes what
    the server and ``LLM.chat`` pass a template: ``tools``, and from ``chat_template_kwargs``
    ``thinking`` (or ``enable_thinking``; chat mode by default, as vLLM), ``reasoning_effort`` and
    ``drop_thinking``; other template variables (``tool_choice``...) mean nothing to it."""

    name = "deepseek_v4"

    def __call__(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True, **kw: Any) -> str:
        return encode_messages(
            messages,
            thinking=bool(kw.get("thinking") or kw.get("enable_thinking")),
            tools=kw.get("tools"),
            drop_thinking=bool(kw.get("drop_thinking", True)),
            reasoning_effort=kw.get("reasoning_effort"),
            add_generation_prompt=add_generation_prompt and not kw.get("continue_final_message"),
            continue_final_message=bool(kw.get("continue_final_message")),
        )
