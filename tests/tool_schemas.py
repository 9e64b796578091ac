"""Function tools the tool-calling tests share, in the chat API's shape; `flat` gives the
Responses API's."""

from __future__ import annotations

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather of a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
            "required": ["city"],
        },
    },
}
TIME = {
    "type": "function",
    "function": {
        "name": "get_time",
        "description": "The time in a zone.",
        "parameters": {
            "type": "object",
            "properties": {"zone": {"enum": ["UTC", "CET"]}},
            "required": ["zone"],
            "additionalProperties": False,
        },
    },
}


def flat(tool: dict) -> dict:
    """A chat tool as the Responses API writes it: {"type": "function", "name", ...}."""
    return {"type": "function", **tool["function"]}
