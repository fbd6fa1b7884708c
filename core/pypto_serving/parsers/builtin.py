"""The built-in parsers, registered through the same hooks as a plugin's."""

from __future__ import annotations

from typing import Any

from ..hookspecs import ReasoningParserSpec, ToolParserSpec, hookimpl
from .base import ReasoningParser, ToolParser
from .reasoning import ThinkReasoningParser
from .tools import DeepSeekDSMLToolParser, DeepSeekV3ToolParser, HermesToolParser

QWEN_ARCHITECTURES = ("Qwen2ForCausalLM", "Qwen3ForCausalLM", "Qwen3MoeForCausalLM")
QWEN3_ARCHITECTURES = ("Qwen3ForCausalLM", "Qwen3MoeForCausalLM")
DEEPSEEK_V3_ARCHITECTURES = ("DeepseekV3ForCausalLM",)
DEEPSEEK_DSML_ARCHITECTURES = ("DeepseekV32ForCausalLM", "DeepseekV4ForCausalLM")


def hermes_parser(tools: list[dict[str, Any]]) -> ToolParser:
    return HermesToolParser(tools)


def deepseek_dsml_parser(tools: list[dict[str, Any]]) -> ToolParser:
    return DeepSeekDSMLToolParser(tools)


def deepseek_v3_parser(tools: list[dict[str, Any]]) -> ToolParser:
    return DeepSeekV3ToolParser(tools)


def think_parser(prompt_text: str) -> ReasoningParser:
    return ThinkReasoningParser(prompt_text)


@hookimpl
def pypto_serving_register_tool_parsers() -> list[ToolParserSpec]:
    return [
        ToolParserSpec(
            "hermes",
            hermes_parser,
            '<tool_call>{"name": ..., "arguments": {...}}</tool_call> (Qwen2.5, Qwen3)',
            QWEN_ARCHITECTURES,
        ),
        ToolParserSpec(
            "deepseek_v4",
            deepseek_dsml_parser,
            "DeepSeek DSML <｜DSML｜tool_calls> blocks (V4; V3.2's <｜DSML｜function_calls> too)",
            DEEPSEEK_DSML_ARCHITECTURES,
        ),
        ToolParserSpec(
            "deepseek_v3",
            deepseek_v3_parser,
            "DeepSeek <｜tool▁calls▁begin｜> blocks (V3 and R1 with fenced JSON, V3.1 with bare JSON)",
            DEEPSEEK_V3_ARCHITECTURES,
        ),
    ]


@hookimpl
def pypto_serving_register_reasoning_parsers() -> list[ReasoningParserSpec]:
    return [
        ReasoningParserSpec("qwen3", think_parser, "<think>...</think> reasoning (Qwen3)", QWEN3_ARCHITECTURES),
        ReasoningParserSpec(
            "deepseek_v4",
            think_parser,
            "<think>...</think> reasoning, opened by the prompt in thinking mode (DeepSeek V3.2, V4)",
            DEEPSEEK_DSML_ARCHITECTURES,
        ),
        ReasoningParserSpec(
            "deepseek_r1",
            think_parser,
            "<think>...</think> reasoning, opened by the prompt (DeepSeek R1, V3.1 thinking mode)",
            DEEPSEEK_V3_ARCHITECTURES,
        ),
    ]
