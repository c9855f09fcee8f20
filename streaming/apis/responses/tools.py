"""The Responses API's tools, as OpenAI defines them: `function` tools, `custom` tools
(free-form input, optionally constrained by a Lark or regex grammar), and `namespace`
tools grouping function and custom tools; given in `tools` or in an `input` item of type
`additional_tools` (Codex CLI sends its tools that way).

The call knows only a flat list of tools (inference/jobs.py ToolSpec), so `Toolset`
flattens them: a tool in a namespace is offered to the model as `<namespace>__<name>`.
Not `namespace.name`: the call's tool-name pattern (`^[A-Za-z0-9_-]{1,64}$`, also
OpenAI's and the upstream engines') has no dot, and a double underscore is what agent
CLIs already use for grouped tools (Codex's `mcp__server__tool`). The flat name must
stay within 64 characters and unique across the request (a top-level `a__b` beside
namespace `a`'s `b` is a 400), so `origin` maps a call's name back to its (namespace,
name) and kind without guessing.
A custom tool is a ToolSpec of kind "custom": the worker constrains its input by its
grammar and answers with the raw text."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Discriminator, Field, StringConstraints, Tag

from inference.jobs import ToolSpec
from sluice.errors import BadRequest
from streaming.apis.responses.wire import Origin

Name = Annotated[str, StringConstraints(pattern=r"^[A-Za-z0-9_-]{1,64}$")]
# Agent CLIs describe tools at length (Codex's `exec`: 13,403 characters).
Description = Annotated[str, StringConstraints(max_length=32768)]
SEPARATOR = "__"
MAX_TOOLS = 128  # in one list; a request's functions in all stay within chat's 128
MAX_GRAMMAR = 65536  # a grammar's definition, in characters


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


def _kind(value: Any) -> str | None:
    """A union member's tag: its `type`, capitalized, so that a validation error's
    location names fields only (responses_input `_param` skips capitalized parts)."""
    kind = value.get("type") if isinstance(value, dict) else getattr(value, "type", None)
    return kind.capitalize() if isinstance(kind, str) else None


def _by_type(expected: str) -> Discriminator:
    return Discriminator(_kind, custom_error_type="invalid_type",
                         custom_error_message=f"type must be one of {expected}")


class ResponsesFunctionTool(_Strict):
    type: Literal["function"]
    name: Name
    description: Description | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class CustomText(_Strict):
    type: Literal["text"]


class CustomGrammar(_Strict):
    type: Literal["grammar"]
    syntax: Literal["lark", "regex"]
    definition: Annotated[str, StringConstraints(min_length=1, max_length=MAX_GRAMMAR)]


class ResponsesCustomTool(_Strict):
    type: Literal["custom"]
    name: Name
    description: Description | None = None
    format: Annotated[Annotated[CustomText, Tag("Text")] | Annotated[CustomGrammar, Tag("Grammar")],
                      _by_type("'text', 'grammar'")] | None = None


Member = Annotated[Annotated[ResponsesFunctionTool, Tag("Function")]
                   | Annotated[ResponsesCustomTool, Tag("Custom")],
                   _by_type("'function', 'custom'")]


class ResponsesNamespaceTool(_Strict):
    type: Literal["namespace"]
    name: Name
    description: Description | None = None
    tools: Annotated[list[Member], Field(min_length=1, max_length=MAX_TOOLS)]


Tool = Annotated[Annotated[ResponsesFunctionTool, Tag("Function")]
                 | Annotated[ResponsesCustomTool, Tag("Custom")]
                 | Annotated[ResponsesNamespaceTool, Tag("Namespace")],
                 _by_type("'function', 'custom', 'namespace'")]
# The tool types served here; any other is a hosted tool (streaming/apis/hosted.py).
OWN_TOOLS = frozenset({"function", "custom", "namespace"})


class AdditionalTools(BaseModel):
    """An `input` item offering tools from where it stands (OpenAI's `additional_tools`);
    here they join the request's `tools`."""

    model_config = ConfigDict(extra="forbid")
    type: Literal["additional_tools"]
    id: Annotated[str, StringConstraints(max_length=128)] | None = None
    role: Literal["developer"]
    tools: Annotated[list[Tool], Field(max_length=MAX_TOOLS)]


class ResponsesToolChoice(_Strict):
    """A named tool to call: OpenAI's `{"type": "function" | "custom", "name"}`; a tool in
    a namespace is named by `namespace` beside `name`, or by its flat name."""

    type: Literal["function", "custom"]
    name: Annotated[str, StringConstraints(max_length=200)]
    namespace: Name | None = None


@dataclass
class Toolset:
    """A request's tools as the flat list the call offers (`specs`)."""

    specs: list[ToolSpec] = field(default_factory=list)
    origins: dict[str, Origin] = field(default_factory=dict)
    namespaces: set[str] = field(default_factory=set)

    @classmethod
    def of(cls, given: list[tuple[str, Any]]) -> Toolset:
        """The tools of `given` (each a tool and the parameter that names it); a 400
        naming the first name that collides or does not fit."""
        out = cls()
        for where, tool in given:
            if isinstance(tool, ResponsesNamespaceTool):
                if tool.name in out.namespaces:
                    raise BadRequest(f"Duplicate namespace name '{tool.name}'.",
                                     param=f"{where}.name", code="invalid_value")
                out.namespaces.add(tool.name)
                for j, member in enumerate(tool.tools):
                    out._add(member, f"{where}.tools[{j}]", tool.name)
            else:
                out._add(tool, where, None)
        return out

    def _add(self, tool: ResponsesFunctionTool | ResponsesCustomTool, where: str,
             namespace: str | None) -> None:
        flat = flat_name(tool.name, namespace)
        if len(flat) > 64:
            raise BadRequest(f"Tool name '{flat}' (namespace and name) is longer than 64 "
                             "characters.", param=f"{where}.name", code="invalid_value")
        if flat in self.origins:
            raise BadRequest(f"Duplicate tool name '{flat}' (a namespaced tool is named "
                             f"<namespace>{SEPARATOR}<name>).", param=f"{where}.name",
                             code="invalid_value")
        self.origins[flat] = Origin(tool.type, tool.name, namespace)
        description = tool.description or ""
        if isinstance(tool, ResponsesFunctionTool):
            self.specs.append(ToolSpec(flat, tool.parameters, bool(tool.strict), description))
        else:
            fmt = tool.format
            syntax, definition = ((fmt.syntax, fmt.definition)
                                  if isinstance(fmt, CustomGrammar) else ("", ""))
            self.specs.append(ToolSpec(flat, None, False, description, kind="custom",
                                       syntax=syntax, definition=definition))

    def origin(self, flat: str) -> Origin:
        """What the model's call of `flat` calls (a name not offered: itself)."""
        return self.origins.get(flat) or Origin("function", flat)

    def choice(self, choice: ResponsesToolChoice) -> str:
        """The flat name `choice` forces; a 400 when it is not among the tools."""
        flat = flat_name(choice.name, choice.namespace)
        found = self.origins.get(flat)
        if found is None or found.kind != choice.type:
            raise BadRequest(f"tool_choice names {choice.type} '{flat}', which is not among "
                             "the tools.", param="tool_choice.name", code="invalid_value")
        return flat


def flat_name(name: str, namespace: str | None) -> str:
    return f"{namespace}{SEPARATOR}{name}" if namespace else name
