"""What agents ask of the fleet, as data shared by the constraint tests and benchmarks (issue 21).

A nested JSON schema with everything the targets name (an enum, integer bounds, an array with
``maxItems``, required keys, ``additionalProperties: false``), a set of function tools in
OpenAI's shape, and twelve different user turns that ask for them.  Nothing here runs anything:
it must stay plain data.
"""

from __future__ import annotations

from typing import Any

NESTED_SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 24},
        "country": {"enum": ["France", "Germany", "Italy", "Spain", "Other"]},
        "population_millions": {"type": "integer", "minimum": 0, "maximum": 40},
        "landmarks": {
            "type": "array",
            "items": {"type": "string", "maxLength": 24},
            "maxItems": 3,
        },
        "weather": {
            "type": "object",
            "properties": {
                "season": {"enum": ["winter", "spring", "summer", "autumn"]},
                "celsius": {"type": "integer", "minimum": -30, "maximum": 45},
            },
            "required": ["season", "celsius"],
            "additionalProperties": False,
        },
    },
    "required": ["city", "country", "population_millions", "landmarks", "weather"],
    "additionalProperties": False,
}
"""The nested schema of the ``json_schema`` target: 8 of 8 answers must validate."""

NESTED_INSTANCE = (
    '{"city": "Paris", "country": "France", "population_millions": 2, '
    '"landmarks": ["Eiffel Tower", "Louvre"], "weather": {"season": "spring", "celsius": 18}}'
)
"""One answer that validates against :data:`NESTED_SCHEMA`, written as the grammar writes JSON."""

CITY_QUESTIONS = [
    "Describe Paris as JSON.",
    "Describe Berlin as JSON.",
    "Describe Rome as JSON.",
    "Describe Madrid as JSON.",
    "Tell me about Lyon in JSON.",
    "Give me Munich as a JSON object.",
    "Describe Venice as JSON.",
    "Describe Barcelona as JSON.",
]
"""Eight prompts for the ``json_schema`` target."""

TOOLS: list[dict[str, Any]] = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "The current weather in a city.",
            "parameters": {
                "type": "object",
                "properties": {
                    "city": {"type": "string", "maxLength": 32},
                    "unit": {"enum": ["celsius", "fahrenheit"]},
                },
                "required": ["city", "unit"],
                "additionalProperties": False,
            },
        },
    },
    {
        "type": "function",
        "function": {
            "name": "add_numbers",
            "description": "Add two integers.",
            "parameters": {
                "type": "object",
                "properties": {
                    "a": {"type": "integer", "minimum": -1000, "maximum": 1000},
                    "b": {"type": "integer", "minimum": -1000, "maximum": 1000},
                },
                "required": ["a", "b"],
                "additionalProperties": False,
            },
        },
    },
    {
        "type": "function",
        "function": {
            "name": "send_email",
            "description": "Send a short email.",
            "parameters": {
                "type": "object",
                "properties": {
                    "to": {"type": "string", "maxLength": 40},
                    "subject": {"type": "string", "maxLength": 40},
                    "urgent": {"type": "boolean"},
                },
                "required": ["to", "subject", "urgent"],
                "additionalProperties": False,
            },
        },
    },
]
"""Three function tools in OpenAI's ``tools`` shape."""

TOOL_CALL_INSTANCE = (
    '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}'
    "</tool_call>"
)
"""One call of :data:`TOOLS` as the generic rendering writes it."""

USER_TURNS = [
    "What is the weather in Paris?",
    "Is it cold in Oslo right now? Use fahrenheit.",
    "What is 12 plus 30?",
    "Add 7 and -3 for me.",
    "Email bob@example.com that the meeting moved, it is urgent.",
    "Send alice@example.com a note saying hello.",
    "How warm is it in Cairo?",
    "Please compute 250 + 250.",
    "Tell Carol (carol@example.com) the report is late.",
    "Weather in Tokyo, in celsius please.",
    "What do you get when you add 99 and 1?",
    "Let my boss at boss@example.com know I am sick, urgently.",
]
"""Twelve different user turns for the ``required`` and named ``tool_choice`` targets."""
