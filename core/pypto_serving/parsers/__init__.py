"""Output parsers of the OpenAI server: tool calls and reasoning, as plugins (see
:func:`pypto_serving.hookspecs.pypto_serving_register_tool_parsers`)."""

from .base import ParsedToolCall, ReasoningParser, ToolParser, partial_suffix
from .output import OutputParser, ParsedOutput
from .reasoning import ThinkReasoningParser
from .tools import BlockToolParser, DeepSeekDSMLToolParser, DeepSeekV3ToolParser, HermesToolParser

__all__ = [
    "BlockToolParser",
    "DeepSeekDSMLToolParser",
    "DeepSeekV3ToolParser",
    "HermesToolParser",
    "OutputParser",
    "ParsedOutput",
    "ParsedToolCall",
    "ReasoningParser",
    "ThinkReasoningParser",
    "ToolParser",
    "partial_suffix",
]
