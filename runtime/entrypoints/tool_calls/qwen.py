"""Qwen2.5 / Qwen3 format: Hermes-style `<tool_call>` blocks, which their chat templates render themselves
(tools in the system turn, results as `<tool_response>` user turns). Registered under its own name so that
`auto` names the family; a Qwen3 `<think>...</think>` block before the calls stays message content."""

from __future__ import annotations

from runtime.entrypoints.tool_calls.base import register
from runtime.entrypoints.tool_calls.hermes import HermesParser


@register
class QwenParser(HermesParser):
    name = "qwen"
    template_markers = ("You are Qwen", "</think>")
