"""What a rollout is: a user's async function that runs a small program for one prompt, calling
the job's server any number of times through `generate`, and returns the prompt's answer.

    async def revise(prompt: Prompt, generate: Generate) -> dict[str, Any]:
        draft = await generate(prompt_body(prompt))
        critique = await generate({"messages": [..., {"role": "user", "content": "Critique ..."}]})
        final = await generate({"messages": [...]})
        return {"content": completion_text(final), "draft": completion_text(draft)}

`prompt` is the input line as read: its `id`, `line`, `messages`, `tools` (when it has them)
and `sampling` (the job's defaults under the line's own values, `n` included when the line
gives one). `await generate(body)` takes an OpenAI chat request body (the worker sets `model`,
and the job's sampling defaults go under the body's own values) and returns the server's chat
completion as OpenAI's JSON. Every call goes through the worker's one door to its server, as
a plain prompt's request does: flow control, rotation, retries, causes.

A rollout runs durably (workers/rollouts.py): each call's result is journaled the moment it
arrives, and a rollout that runs again after a crash gets its journaled calls back at once, in
order, so it must ask the same given the same answers. What it draws at random comes from
`generate.random`, seeded by the job and the prompt; CPU work (tools, verifiers) goes through
`await generate.run(fn, *args)`, off the event loop.

A rollout is named at enqueue as `module:attribute` and recorded in the job's manifest with a
digest of its module's source (`RolloutSpec`; with the module that defines the named object, when another): a worker that imports another version of the
module refuses the job's batches rather than run a different program on part of the job.
The attribute is the rollout itself, or a class whose instance is (built with the job's
rollout options): `fleetgen.rollouts:RetryUnusable` with options `{"tries": 5}`.
"""

from __future__ import annotations

import hashlib
import importlib
import inspect
import random
import sys
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass, field
from typing import Any, Protocol, TypeVar

import orjson

from fleetgen.errors import RolloutError

T = TypeVar("T")

# One prompt as a rollout receives it, the bodies it sends and the completions it gets back:
# OpenAI's JSON as plain dicts, the contract users already know.
Prompt = dict[str, Any]
Body = dict[str, Any]
Completion = dict[str, Any]

# The prompt fields that are not sampling parameters (the rest of a stored body is).
_NOT_SAMPLING = ("messages", "tools", "tool_choice", "model", "stream")


class Generate(Protocol):
    """What a rollout is given to reach the server: call it with a chat request body."""

    # Seeded by the job and the prompt: the same draws every time the rollout runs.
    random: random.Random

    async def __call__(self, body: Body) -> Completion:
        """The server's chat completion for `body`; CallFailed when the request failed for
        good (refused, or its tries ran out). A call is numbered when it is made, before it
        awaits anything, so calls started together (asyncio.gather) keep the order they were
        started in, run after run."""
        ...

    async def run(self, fn: Callable[..., T], /, *args: Any, **kwargs: Any) -> T:
        """`fn(*args, **kwargs)` in the worker's pool for rollout CPU work, within what is
        left of the rollout's own time limit."""
        ...

    @property
    def calls(self) -> int:
        """Calls made so far (journaled ones included)."""
        ...


Rollout = Callable[[Prompt, Generate], Awaitable[dict[str, Any]]]


class CallFailed(Exception):
    """One call's request failed for good: the server refused it (the prompt's fault, or the
    job's: `code` says, as a prompt's failure record does) or its tries ran out. A rollout may
    catch it (a chunk too long for the context, say); uncaught, it fails the prompt with the
    call's code and message."""

    def __init__(self, index: int, code: str, message: str, status: int | None = None) -> None:
        super().__init__(f"call {index}: {message}")
        self.index = index
        self.code = code
        self.message = message
        self.status = status


@dataclass(frozen=True)
class RolloutSpec:
    """A job's rollout as its manifest keeps it: `module:attribute`, the sha256 of the
    module's source, the options its class is built with, and whether every call is kept in
    the prompt's record (`--keep-calls`)."""

    name: str
    digest: str
    options: dict[str, Any] = field(default_factory=dict)
    keep_calls: bool = False

    @classmethod
    def of(cls, name: str, options: dict[str, Any] | None = None,
           keep_calls: bool = False) -> RolloutSpec:
        """The spec of rollout `name` as this process imports it; RolloutError saying why
        it cannot be used (not importable, not a rollout, options it does not take)."""
        options = dict(options or {})
        _, digest = _build(name, options)
        return cls(name, digest, options, keep_calls)

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> RolloutSpec:
        return cls(**raw)

    def load(self) -> Rollout:
        """The rollout, imported here and built; RolloutError when it cannot be imported or
        this process has another version of its module than the job's."""
        rollout, digest = _build(self.name, self.options)
        if digest != self.digest:
            module = self.name.partition(":")[0]
            raise RolloutError(
                f"rollout {self.name}: module {module} here ({_origin(module)}) is another "
                f"version than the job's (source sha256 {digest[:12]}, the job's "
                f"{self.digest[:12]}); install the job's version on this node")
        return rollout


def prompt_body(prompt: Prompt, **overrides: Any) -> Body:
    """The chat request body of `prompt` as its line asked it (messages, tools, sampling),
    with `overrides` on top: `prompt_body(prompt, max_tokens=8192)`."""
    body: Body = {"messages": prompt["messages"], **prompt.get("sampling", {})}
    for name in ("tools", "tool_choice"):
        if name in prompt:
            body[name] = prompt[name]
    body.update(overrides)
    return body


def rollout_prompt(prompt_id: str, line: int, body: Body) -> Prompt:
    """What a rollout receives for the prompt whose stored request body is `body`."""
    prompt: Prompt = {"id": prompt_id, "line": line, "messages": body.get("messages", [])}
    for name in ("tools", "tool_choice"):
        if name in body:
            prompt[name] = body[name]
    prompt["sampling"] = {k: v for k, v in body.items() if k not in _NOT_SAMPLING}
    return prompt


def completion_message(completion: Completion) -> dict[str, Any]:
    """The message of a completion's first choice ({} when it has none): its `content`,
    `reasoning_content`, `tool_calls`."""
    choices = completion.get("choices") or [{}]
    message = choices[0].get("message") or {}
    return message if isinstance(message, dict) else {}


def completion_text(completion: Completion) -> str:
    """The content of a completion's first choice ("" when it has none)."""
    return completion_message(completion).get("content") or ""


def finish_reason(completion: Completion) -> str | None:
    """Why the first choice ended: "stop", "length" (the max_tokens cap), "tool_calls"."""
    choices = completion.get("choices") or [{}]
    reason = choices[0].get("finish_reason")
    return reason if isinstance(reason, str) else None


def request_digest(body: Body) -> str:
    """What a journaled call is recognised by when the rollout runs again: the sha256 of its
    body with sorted keys (a replayed call must ask exactly this)."""
    return hashlib.sha256(orjson.dumps(body, option=orjson.OPT_SORT_KEYS)).hexdigest()[:32]


def _build(name: str, options: dict[str, Any]) -> tuple[Rollout, str]:
    module_name, sep, attribute = name.partition(":")
    if not sep or not module_name or not attribute:
        raise RolloutError(f"rollout {name!r}: name it as module:attribute "
                           "(e.g. mypkg.flows:revise)")
    try:
        module = importlib.import_module(module_name)
    except Exception as exc:  # noqa: BLE001 (whatever importing user code raises is its reason)
        raise RolloutError(f"rollout {name}: cannot import {module_name} "
                           f"({type(exc).__name__}: {exc}); it must be importable on the "
                           "producer's machine and on every worker node") from None
    target = module
    for part in attribute.split("."):
        if not hasattr(target, part):
            raise RolloutError(f"rollout {name}: {module_name} has no {attribute}")
        target = getattr(target, part)
    # The named module and the one that defines what it names (a shipped rollout's class
    # built in the user's module with the user's tools): a change to either is another program.
    defined = getattr(target if inspect.isclass(target) or inspect.isfunction(target)
                      else type(target), "__module__", module_name)
    digest = _modules_digest(dict.fromkeys((module_name, defined)))
    if inspect.isclass(target):
        try:
            built = target(**options)
        except (TypeError, ValueError) as exc:
            raise RolloutError(f"rollout {name}: its options {options} do not fit ({exc})") from None
    elif options:
        raise RolloutError(f"rollout {name}: options are given, but it is a function, not a "
                           "class to build with them")
    else:
        built = target
    if not callable(built) or not _is_async(built):
        raise RolloutError(f"rollout {name}: not an async function of (prompt, generate)")
    return built, digest


def _is_async(obj: Any) -> bool:
    return inspect.iscoroutinefunction(obj) or inspect.iscoroutinefunction(
        getattr(obj, "__call__", None))  # noqa: B004 (an instance with an async __call__)


def _modules_digest(module_names: Iterable[str]) -> str:
    digest = hashlib.sha256()
    for module_name in module_names:
        path = _origin(module_name)
        try:
            with open(path, "rb") as source:
                digest.update(source.read())
        except OSError as exc:
            raise RolloutError(f"rollout module {module_name}: its source cannot be read "
                               f"({exc}); a rollout's module must be a .py file") from None
    return digest.hexdigest()


def _origin(module_name: str) -> str:
    module = sys.modules.get(module_name)
    path = getattr(module, "__file__", None) if module is not None else None
    return str(path) if path else "<no file>"
