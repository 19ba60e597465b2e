"""The chat-shaped wire formats over one conversation layer (`conversation`): OpenAI's Responses API
(`responses`, `responses_routes`, `store`) and Anthropic's Messages API (`anthropic`). Chat Completions
(`runtime.entrypoints.openai`) plans its tools through the same `conversation.plan_tools`."""

from runtime.entrypoints.wire.anthropic import register_messages_routes
from runtime.entrypoints.wire.responses_routes import register_responses_routes

__all__ = ["register_messages_routes", "register_responses_routes"]
