"""Let the model call Python functions until it answers: the agent loop of one prompt.

The user registers plain functions; the model sees them as OpenAI tools (the prompt's own
`tools`, or schemas built from the functions' signatures). Each answer that calls tools gets
their results back as `tool` messages, run in the worker's pool, and the model is asked again,
until an answer calls none or `turns` calls are spent. A tool's failure is told to the model as
the tool's result ("error: ..."), so it can recover; it never fails the prompt.

    # mypkg/flows.py, enqueued as --rollout mypkg.flows:flow
    def add(a: int, b: int) -> int:
        "Add two integers."
        return a + b

    flow = ToolLoop(tools={"add": add})
"""

from __future__ import annotations

import inspect
import json
import types
import typing
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from fleetgen.errors import RolloutError
from fleetgen.rollouts._contract import (
    Completion,
    Generate,
    Prompt,
    completion_message,
    completion_text,
    finish_reason,
    prompt_body,
)

# The parameter types a schema is built for, as JSON Schema names them.
_JSON_TYPES: dict[Any, str] = {str: "string", int: "integer", float: "number", bool: "boolean"}


# Compared and hashed by identity: its tools are functions in a dict, not values.
@dataclass(frozen=True, eq=False)
class ToolLoop:
    """Call the model with `tools` (name -> plain function) until an answer calls no tool, or
    for `turns` calls at most. The model sees the prompt's own `tools` when it has them, else
    `schemas` when given, else schemas built from the functions' signatures: str, int, float
    and bool parameters (or `X | None`), required when they have no default, described by the
    docstring's first line.

    Answer: `content` (the last answer's), `finish_reason` (the last answer's), `turns` (calls
    made), `tool_calls` (tools run), `capped` (the last answer still called tools: `turns`
    ran out) and `messages` (the whole conversation, the answers and tool results included).
    """

    tools: Mapping[str, Callable[..., Any]]
    turns: int = 8
    schemas: list[dict[str, Any]] | None = None
    # What the model is shown when the prompt has no tools: `schemas`, or the built ones.
    tool_schemas: list[dict[str, Any]] = field(init=False, repr=False)

    def __post_init__(self) -> None:
        if not isinstance(self.tools, Mapping) or not self.tools:
            raise RolloutError("ToolLoop: tools must map at least one name to a function")
        for name, fn in self.tools.items():
            if not callable(fn) or inspect.iscoroutinefunction(fn):
                raise RolloutError(f"ToolLoop: tool {name!r} must be a plain function (it runs "
                                   f"in the worker's pool), not {fn!r}")
        if isinstance(self.turns, bool) or not isinstance(self.turns, int) or self.turns < 1:
            raise RolloutError(f"ToolLoop: turns must be a positive integer, not {self.turns!r}")
        if self.schemas is not None and not isinstance(self.schemas, list):
            raise RolloutError("ToolLoop: schemas must be a list of OpenAI tool definitions")
        # Copied, so that a later change to the caller's dict cannot change a running job.
        object.__setattr__(self, "tools", dict(self.tools))
        object.__setattr__(self, "tool_schemas", list(self.schemas) if self.schemas is not None
                           else [tool_schema(name, fn) for name, fn in self.tools.items()])

    async def __call__(self, prompt: Prompt, generate: Generate) -> dict[str, Any]:
        messages: list[dict[str, Any]] = list(prompt["messages"])
        shown = {} if "tools" in prompt else {"tools": self.tool_schemas}
        calls = executed = 0
        completion: Completion = {}
        while calls < self.turns:
            completion = await generate(prompt_body(prompt, messages=list(messages), **shown))
            calls += 1
            message = completion_message(completion)
            requested = message.get("tool_calls") or []
            # Some chat templates fail on a null content: an assistant turn keeps a string.
            turn: dict[str, Any] = {"role": "assistant", "content": message.get("content") or ""}
            if requested:
                turn["tool_calls"] = requested
            messages.append(turn)
            if not requested or calls == self.turns:
                break
            for k, call in enumerate(requested):
                result = await self._run(call, generate)
                executed += 1
                call_id = call.get("id") or f"call_{calls}_{k}"
                messages.append({"role": "tool", "tool_call_id": call_id, "content": result})
        return {
            "content": completion_text(completion),
            "finish_reason": finish_reason(completion),
            "turns": calls,
            "tool_calls": executed,
            "capped": bool(completion_message(completion).get("tool_calls")),
            "messages": messages,
        }

    async def _run(self, call: dict[str, Any], generate: Generate) -> str:
        """The tool message's content for one tool call: its result, or "error: ..."."""
        function = call.get("function") or {}
        name = function.get("name")
        fn = self.tools.get(name) if isinstance(name, str) else None
        if fn is None:
            return f"error: no tool named {name!r}; the tools are {', '.join(self.tools)}"
        arguments = function.get("arguments") or "{}"
        if isinstance(arguments, str):
            try:
                arguments = json.loads(arguments)
            except json.JSONDecodeError as exc:
                return f"error: the arguments of {name} are not valid JSON ({exc})"
        if not isinstance(arguments, dict):
            return f"error: the arguments of {name} must be a JSON object"
        return await generate.run(_call_tool, fn, arguments)


def tool_schema(name: str, fn: Callable[..., Any]) -> dict[str, Any]:
    """The OpenAI tool definition of `fn` called `name`, from its signature and type hints;
    RolloutError for a parameter no schema is built for."""
    try:
        hints = typing.get_type_hints(fn)
    except Exception:  # noqa: BLE001 (an unresolvable hint is reported per parameter below)
        hints = {}
    properties: dict[str, Any] = {}
    required: list[str] = []
    for parameter in inspect.signature(fn).parameters.values():
        if parameter.kind not in (parameter.POSITIONAL_OR_KEYWORD, parameter.KEYWORD_ONLY):
            raise RolloutError(f"ToolLoop: tool {name!r}: parameter {parameter.name} is not "
                               "passed by name (*args, **kwargs, positional-only); give schemas")
        json_type = _json_type(hints.get(parameter.name))
        if json_type is None:
            raise RolloutError(f"ToolLoop: tool {name!r}: parameter {parameter.name} needs a "
                               "type hint of str, int, float or bool (or X | None) for its "
                               "schema to be built; or give schemas")
        properties[parameter.name] = {"type": json_type}
        if parameter.default is parameter.empty:
            required.append(parameter.name)
    definition: dict[str, Any] = {"name": name}
    doc = inspect.getdoc(fn)
    if doc:
        definition["description"] = doc.strip().splitlines()[0]
    definition["parameters"] = {"type": "object", "properties": properties, "required": required}
    return {"type": "function", "function": definition}


def _json_type(hint: Any) -> str | None:
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        others = [arg for arg in typing.get_args(hint) if arg is not type(None)]
        hint = others[0] if len(others) == 1 else None
    return _JSON_TYPES.get(hint)


def _call_tool(fn: Callable[..., Any], arguments: dict[str, Any]) -> str:
    """`fn(**arguments)` as a tool message's content: a string as it is, anything else as
    JSON; what the tool raises (wrong arguments included) as "error: ..."."""
    try:
        result = fn(**arguments)
    except Exception as exc:  # noqa: BLE001 (the model is told and may recover)
        return f"error: {type(exc).__name__}: {exc}"
    return result if isinstance(result, str) else json.dumps(result, ensure_ascii=False,
                                                             default=str)


