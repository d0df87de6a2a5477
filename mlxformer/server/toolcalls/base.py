"""The tool-call parser interface: a ``CallFormat`` reads the calls in a section of generated text
(what follows one of its markers); ``ToolCallStream`` (``stream.py``) drives it over text that
arrives piece by piece. A format is a pure function of the text so far, so feeding a reply token
by token and feeding it whole give the same content and calls."""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field
from typing import Any, ClassVar


@dataclass
class CallDelta:
    """One streamed piece of a call: the first carries ``id`` and ``name``, later ones only
    ``arguments`` fragments (OpenAI's ``delta.tool_calls`` entries)."""

    index: int
    arguments: str = ""
    id: str | None = None
    name: str | None = None


@dataclass
class ToolCall:
    """A whole call: ``arguments`` is a JSON object as text (OpenAI's string form)."""

    id: str
    name: str
    arguments: str = ""

    def to_openai(self) -> dict[str, Any]:
        """The ``tool_calls`` entry of an OpenAI chat message."""
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


@dataclass
class Section:
    """What a format read of one call section so far.

    ``calls``: ``(name, arguments text so far)`` for each call begun (each text only grows as
    more arrives); ``end``: how many characters of the section body the calls took, once the
    section is closed (the rest is text again); ``failed``: the body is no call after all (the
    marker and body are text)."""

    calls: list[tuple[str, str]] = field(default_factory=list)
    end: int | None = None
    failed: bool = False


@dataclass(frozen=True)
class ToolSpec:
    """What formats need to know about the offered functions: name -> JSON Schema of the parameters."""

    parameters: dict[str, dict[str, Any]]

    @property
    def names(self) -> set[str]:
        return set(self.parameters)


class CallFormat:
    """One family's tool-call format.

    ``markers``: literal texts that open a call section; ``bare_json``: a reply may also open
    with a JSON call and no marker (the section marker is then ``""``).
    """

    name: ClassVar[str]
    markers: ClassVar[tuple[str, ...]] = ()
    bare_json: ClassVar[bool] = False
    # The format also carries reasoning and content channels (Harmony): every reply is read by
    # its stream, tools offered or not.
    channels: ClassVar[bool] = False

    def new_id(self) -> str:
        """A fresh call id in the form this family's templates accept."""
        return new_call_id()

    def read(self, marker: str, body: str, final: bool, tools: ToolSpec) -> Section:
        """The calls in ``body``, the text after ``marker`` (``final``: no more text will come)."""
        raise NotImplementedError

    def forced_grammar(self, names: list[str], tools: ToolSpec) -> str:
        """A Lark grammar (llguidance's dialect) of one call of any of ``names``, in this format."""
        raise NotImplementedError
