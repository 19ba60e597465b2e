"""Two small OpenAI tools shared by the tool-calling unit tests (the regex path and the Lark path)."""

from runtime.entrypoints.tool_calls.schema import parse_tools

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "days": {"type": "integer", "minimum": 1}},
            "required": ["city", "days"],
        },
    },
}
CALC = {
    "type": "function",
    "function": {
        "name": "calc",
        "parameters": {"type": "object", "properties": {"expr": {"type": "string"}}, "required": ["expr"]},
    },
}
TOOLS = parse_tools([WEATHER, CALC])
