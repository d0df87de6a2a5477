"""OpenAI-style tool calling over structured output: check ``tools``/``tool_choice``, build the
JSON Schema a forced call must follow and describe the tools to templates that do not take
them (reading calls back out of the text: ``mlxformer.server.toolcalls``).

A call is generated as ``{"name": ..., "arguments": {...}}``; with ``tool_choice`` ``"required"``
or a named function the output is constrained to that shape, with ``arguments`` following the
function's ``parameters`` schema.
"""

from __future__ import annotations

import json
import re
from typing import Any

from mlxformer.errors import MlxformerError


def function_specs(tools: list[dict[str, Any]] | None) -> dict[str, dict[str, Any]]:
    """``name -> {"name", "description", "parameters"}`` of OpenAI ``tools``; raises
    ``MlxformerError`` on a malformed list."""
    specs: dict[str, dict[str, Any]] = {}
    for i, tool in enumerate(tools or []):
        function = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(tool, dict) or tool.get("type", "function") != "function" or not isinstance(function, dict):
            raise MlxformerError(f"tools[{i}] must be {{\"type\": \"function\", \"function\": {{...}}}}")
        name = function.get("name")
        if not isinstance(name, str) or not re.fullmatch(r"[A-Za-z0-9_.-]{1,64}", name):
            raise MlxformerError(f"tools[{i}].function.name must be 1-64 letters, digits, '_', '.' or '-'")
        if name in specs:
            raise MlxformerError(f"tools: the function name {name!r} is given twice")
        parameters = function.get("parameters", {"type": "object", "properties": {}})
        if not isinstance(parameters, dict):
            raise MlxformerError(f"tools[{i}].function.parameters must be a JSON Schema object")
        specs[name] = {"name": name, "description": function.get("description", ""), "parameters": parameters}
    return specs


def forced_functions(tools: list[dict[str, Any]] | None, tool_choice: str | dict[str, Any] | None) -> list[str]:
    """The functions one of which must be called: all for ``"required"``, the named one for
    ``{"type": "function", "function": {"name": ...}}``, none for ``"auto"``/``"none"``/absent."""
    specs = function_specs(tools)
    if tool_choice is None or tool_choice in ("auto", "none"):
        return []
    if tool_choice == "required":
        if not specs:
            raise MlxformerError("tool_choice 'required' needs at least one tool")
        return list(specs)
    if isinstance(tool_choice, dict):
        function = tool_choice.get("function")
        name = function.get("name") if isinstance(function, dict) else None
        if name not in specs:
            raise MlxformerError(f"tool_choice names the function {name!r}, which is not among the tools")
        return [name]
    raise MlxformerError("tool_choice must be 'none', 'auto', 'required' or {\"type\": \"function\", ...}")


def tool_call_schema(tools: list[dict[str, Any]] | None, names: list[str]) -> dict[str, Any]:
    """The JSON Schema of one call of any of the functions ``names``."""
    specs = function_specs(tools)
    return call_schema({name: spec["parameters"] for name, spec in specs.items()}, names)


def call_schema(parameters: dict[str, dict[str, Any]], names: list[str], arguments_key: str = "arguments"
                ) -> dict[str, Any]:
    """The JSON Schema of one ``{"name": ..., "<arguments_key>": {...}}`` call of any of ``names``
    (``parameters``: each function's parameter schema)."""
    branches = [
        {
            "type": "object",
            "properties": {"name": {"const": name}, arguments_key: parameters[name]},
            "required": ["name", arguments_key],
            "additionalProperties": False,
        }
        for name in names
    ]
    return branches[0] if len(branches) == 1 else {"anyOf": branches}


def template_takes_tools(chat_template: str | None) -> bool:
    """Whether a chat template renders the ``tools`` variable."""
    return chat_template is not None and re.search(r"\btools\b", chat_template) is not None


def tools_system_text(tools: list[dict[str, Any]] | None) -> str:
    """Tool descriptions for a system message, for templates that do not take ``tools``."""
    specs = function_specs(tools)
    lines = ["You can call these functions:"]
    lines += [json.dumps(spec, ensure_ascii=False) for spec in specs.values()]
    lines.append('To call one, reply with only a JSON object: {"name": <function name>, "arguments": <arguments>}.')
    return "\n".join(lines)


def with_tools(messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None,
               chat_template: str | None) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """``(messages, template keywords)`` that present ``tools`` to the model: as the template's
    ``tools`` variable when it renders one, else in the system message."""
    if not tools:
        return messages, {}
    if template_takes_tools(chat_template):
        return messages, {"tools": [_described(tool) for tool in tools]}
    text = tools_system_text(tools)
    if messages and messages[0].get("role") == "system" and isinstance(messages[0].get("content"), str):
        return [{**messages[0], "content": messages[0]["content"] + "\n\n" + text}, *messages[1:]], {}
    return [{"role": "system", "content": text}, *messages], {}


def _described(tool: dict[str, Any]) -> dict[str, Any]:
    """A function tool with a ``description`` (OpenAI's is optional; templates such as gpt-oss's
    read it unconditionally)."""
    function = tool.get("function")
    if isinstance(function, dict) and "description" not in function:
        return {**tool, "function": {**function, "description": ""}}
    return tool
