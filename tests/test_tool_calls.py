"""Tool calling over structured output: tools/tool_choice checks, the forced-call schema (checked
with ``jsonschema``), the tools in the prompt (reading calls back: ``test_toolcall_formats.py``). Forced calls on the
real model, through the openai client: ``test_server_tools.py``."""

from __future__ import annotations

import re

import jsonschema
import pytest

from mlxformer.constrained.tools import (
    forced_functions, template_takes_tools, tool_call_schema, with_tools,
)
from mlxformer.errors import MlxformerError

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 30},
                           "unit": {"enum": ["celsius", "fahrenheit"]}},
            "required": ["city", "unit"],
            "additionalProperties": False,
        },
    },
}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"zone": {"type": "string", "pattern": "^[A-Z]{3}$"}}, "required": ["zone"]}}}
TOOLS = [WEATHER, TIME]


def test_tool_choice():
    assert forced_functions(TOOLS, None) == forced_functions(TOOLS, "auto") == forced_functions(TOOLS, "none") == []
    assert forced_functions(TOOLS, "required") == ["get_weather", "get_time"]
    assert forced_functions(TOOLS, {"type": "function", "function": {"name": "get_time"}}) == ["get_time"]
    for tools, choice, needle in [
        (TOOLS, {"type": "function", "function": {"name": "nope"}}, "not among the tools"),
        ([], "required", "at least one tool"),
        (TOOLS, "always", "tool_choice must be"),
        ([{"type": "function"}], "auto", "tools[0]"),
        ([{"type": "function", "function": {"name": "bad name!"}}], "auto", "function.name"),
        ([WEATHER, WEATHER], "auto", "given twice"),
    ]:
        with pytest.raises(MlxformerError, match=re.escape(needle)):
            forced_functions(tools, choice)


def test_call_schema_accepts_exactly_calls():
    schema = tool_call_schema(TOOLS, ["get_weather", "get_time"])
    jsonschema.validate({"name": "get_weather", "arguments": {"city": "Oslo", "unit": "celsius"}}, schema)
    jsonschema.validate({"name": "get_time", "arguments": {"zone": "UTC"}}, schema)
    for wrong in [{"name": "get_weather", "arguments": {"city": "Oslo"}},
                  {"name": "get_time", "arguments": {"zone": "utc"}},
                  {"name": "other", "arguments": {}},
                  {"name": "get_time", "arguments": {"zone": "UTC"}, "extra": 1}]:
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(wrong, schema)


def test_tools_reach_the_prompt():
    messages = [{"role": "user", "content": "Weather in Oslo?"}]
    # as given, with an empty description where a tool has none (templates read it unconditionally)
    described = [t if "description" in t["function"] else {**t, "function": {**t["function"], "description": ""}}
                 for t in TOOLS]
    assert any("description" not in t["function"] for t in TOOLS)
    assert with_tools(messages, TOOLS, "{% for t in tools %}{{ t }}{% endfor %}") == (messages, {"tools": described})
    shown, extra = with_tools(messages, TOOLS, "{{ messages }}")
    assert extra == {} and shown[0]["role"] == "system" and "get_weather" in shown[0]["content"]
    shown, _ = with_tools([{"role": "system", "content": "Be brief."}, *messages], TOOLS, None)
    assert shown[0]["content"].startswith("Be brief.") and "get_time" in shown[0]["content"] and len(shown) == 2
    assert not template_takes_tools(None) and template_takes_tools("{% if tools %}x{% endif %}")
