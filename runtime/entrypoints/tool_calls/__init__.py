"""OpenAI tool calling: request validation, prompt rendering, wire-format parsers and constrained calls.

`plan.py` is the one entry the HTTP layer uses; docs/structured-output.md ("Tool calling")
documents the contract.
"""

from runtime.entrypoints.tool_calls.base import PARSER_NAMES, get_parser
from runtime.entrypoints.tool_calls.plan import ToolPlan, plan_chat
from runtime.entrypoints.tool_calls.schema import ToolRequestError

__all__ = ["PARSER_NAMES", "ToolPlan", "ToolRequestError", "get_parser", "plan_chat"]
