"""Tool-call formats, one module each, and the rule that picks one from a chat template
(overridable with ``serve --tool-parser NAME``), as vLLM's ``ToolParserManager`` and mlx-lm's
``tool_parsers``.

- ``base.py``: the ``CallFormat`` interface; ``stream.py``: ``ToolCallStream``, a format driven
  over text arriving piece by piece; ``jsoncalls.py``: JSON calls read while they grow.
- Formats: ``hermes.py`` (Hermes, Qwen2.5/3), ``qwen3_coder.py``, ``llama3.py``,
  ``mistral.py``, ``gemma4.py``, ``glm.py`` (GLM-4.5 to 4.7), ``deepseek.py`` (DeepSeek-V3.1),
  ``harmony.py`` (gpt-oss), ``json_fallback.py`` (templates with no format of their own)."""

from __future__ import annotations

from mlxformer.errors import MlxformerError
from mlxformer.server.toolcalls.base import CallDelta, CallFormat, Section, ToolCall, ToolSpec
from mlxformer.server.toolcalls.harmony import Harmony, HarmonyStream
from mlxformer.server.toolcalls.deepseek import DeepSeekV31
from mlxformer.server.toolcalls.glm import Glm, Glm47
from mlxformer.server.toolcalls.gemma4 import Gemma4
from mlxformer.server.toolcalls.hermes import Hermes
from mlxformer.server.toolcalls.json_fallback import JsonFallback
from mlxformer.server.toolcalls.llama3 import Llama3Json
from mlxformer.server.toolcalls.mistral import Mistral, MistralV11
from mlxformer.server.toolcalls.qwen3_coder import Qwen3Coder
from mlxformer.server.toolcalls.stream import Parsed, ToolCallStream

FORMATS: dict[str, type[CallFormat]] = {
    f.name: f for f in (Hermes, Qwen3Coder, Llama3Json, Mistral, MistralV11, Gemma4, JsonFallback, Harmony, Glm,
                        Glm47, DeepSeekV31)
}

# (format, texts that must all appear in the chat template), first match wins.
TEMPLATE_RULES: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("harmony", ("<|channel|>", "<|message|>")),
    ("gemma4", ("<|tool_call>", "<tool_call|>")),
    ("qwen3_coder", ("<tool_call>", "<function=")),
    ("glm47", ("<tool_call>{function-name}<arg_key>",)),
    ("glm", ("<tool_call>", "<arg_key>")),
    ("deepseek_v3_1", ("<｜tool▁calls▁begin｜>", "<｜tool▁sep｜>")),
    ("hermes", ("<tool_call>",)),
    ("mistral_v11", ("[TOOL_CALLS]", "[ARGS]")),
    ("mistral", ("[TOOL_CALLS]",)),
    ("llama3_json", ('"parameters"', "<|eot_id|>")),
)


def format_for_template(chat_template: str | None) -> str:
    """The name of the call format a chat template teaches (``json`` when it teaches none)."""
    for name, needles in TEMPLATE_RULES:
        if chat_template and all(n in chat_template for n in needles):
            return name
    return JsonFallback.name


def reply_stream(fmt: CallFormat, tools: ToolSpec) -> ToolCallStream | HarmonyStream:
    """The incremental reader of a reply in ``fmt``."""
    return HarmonyStream(fmt, tools) if fmt.channels else ToolCallStream(fmt, tools)


def call_format(name: str) -> CallFormat:
    """The format registered as ``name``; ``MlxformerError`` naming the choices otherwise."""
    try:
        return FORMATS[name]()
    except KeyError:
        raise MlxformerError(f"unknown tool parser {name!r}; choose one of {', '.join(sorted(FORMATS))}") from None


__all__ = [
    "CallDelta", "CallFormat", "FORMATS", "Parsed", "Section", "ToolCall", "ToolCallStream", "ToolSpec",
    "call_format", "format_for_template", "reply_stream",
]
