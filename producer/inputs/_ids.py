"""Prompt ids: what makes one valid, the content-hash id, and a compact index of ids seen.

An id names a prompt's result in object keys and file names, so it must be a non-empty string of at
most 256 characters with no ``/`` and no control characters, and not ``.`` or ``..``.

A line without an id gets a content-hash id, a function of the request body only (never of the
line's position, so reordering or resuming a file keeps every id)::

    canonical = {
        "messages": body["messages"],
        "tools": body.get("tools"),          # null when the line has no tools
        "sampling": {every other key of body},  # {} when the line has no sampling params
    }
    id = "h-" + sha256(orjson.dumps(canonical, option=orjson.OPT_SORT_KEYS)).hexdigest()[:24]

``OPT_SORT_KEYS`` sorts the keys of every nested object, so key order in the JSON does not change
the id. A plain ``{"prompt": "..."}`` line hashes like the equivalent one-user-message chat line.
A body of another endpoint (a completion's ``prompt``, an embedding's ``input``: no ``messages``)
is its own canonical form, the body itself, sorted the same way.
"""

from __future__ import annotations

import hashlib
import re
from array import array
from typing import TYPE_CHECKING

import orjson

if TYPE_CHECKING:  # the servers' package loads httpx, which reading prompts never needs
    from fleetgen.servers import RequestBody

MAX_ID_LENGTH = 256
HASH_ID_PREFIX = "h-"
_HASH_ID_HEX_CHARS = 24  # 96 bits: no collision in any realistic file
# C0 and C1 control characters and "/" break object keys and file names.
_BAD_ID_CHAR = re.compile(r"[\x00-\x1f\x7f-\x9f/]")


def id_problem(prompt_id: str) -> str | None:
    """Say what makes ``prompt_id`` unusable as a prompt id, or return None when it is fine."""
    if not prompt_id:
        return "expected a non-empty string"
    if len(prompt_id) > MAX_ID_LENGTH:
        return f"longer than {MAX_ID_LENGTH} characters ({len(prompt_id)})"
    bad = _BAD_ID_CHAR.search(prompt_id)
    if bad is not None:
        where = f"{bad.group()!r} at character {bad.start() + 1}"
        return f"contains {where}; ids may not contain / or control characters"
    if prompt_id in (".", ".."):
        return f"{prompt_id!r} is not allowed; it names a directory"
    return None


def hash_id(body: RequestBody) -> str:
    """Return the content-hash id of a request body (the module docstring has the recipe)."""
    canonical: object = body
    if "messages" in body:
        canonical = {
            "messages": body["messages"],
            "tools": body.get("tools"),
            "sampling": {k: v for k, v in body.items() if k != "messages" and k != "tools"},
        }
    digest = hashlib.sha256(orjson.dumps(canonical, option=orjson.OPT_SORT_KEYS)).hexdigest()
    return HASH_ID_PREFIX + digest[:_HASH_ID_HEX_CHARS]


class IdIndex:
    """The ids seen so far with the line of each, kept as 8-byte digests, to find duplicates.

    An open-addressing table in two arrays costs 24 bytes per id at most (about 12 at best),
    where a ``dict[str, int]`` of the ids themselves would cost well over 100. Two distinct ids
    share a 64-bit digest with probability about n**2 / 2**65 (3e-8 for a million ids).

        index = IdIndex()
        index.add("a", 1)   # None: first time
        index.add("a", 7)   # 1: the line "a" was first seen on
    """

    _INITIAL_SLOTS = 1 << 16

    def __init__(self) -> None:
        self._digests = array("Q", bytes(8 * self._INITIAL_SLOTS))  # 0 marks an empty slot
        self._lines = array("I", bytes(4 * self._INITIAL_SLOTS))
        self._mask = self._INITIAL_SLOTS - 1
        self._count = 0

    def __len__(self) -> int:
        return self._count

    def add(self, prompt_id: str, line: int) -> int | None:
        """Record ``prompt_id`` as seen on ``line``; if it was seen before, return that line."""
        digest = _digest(prompt_id)
        slot = self._find(digest)
        if self._digests[slot]:
            return self._lines[slot]
        self._digests[slot] = digest
        self._lines[slot] = line
        self._count += 1
        # Linear probing stays short while at most half the slots are used.
        if 2 * self._count > self._mask:
            self._grow()
        return None

    def _find(self, digest: int) -> int:
        digests, mask = self._digests, self._mask
        slot = digest & mask
        while digests[slot] and digests[slot] != digest:
            slot = (slot + 1) & mask
        return slot

    def _grow(self) -> None:
        old = zip(self._digests, self._lines, strict=False)
        slots = 2 * (self._mask + 1)
        self._digests = array("Q", bytes(8 * slots))
        self._lines = array("I", bytes(4 * slots))
        self._mask = slots - 1
        for digest, line in old:
            if digest:
                slot = self._find(digest)
                self._digests[slot] = digest
                self._lines[slot] = line


def _digest(prompt_id: str) -> int:
    raw = hashlib.blake2b(prompt_id.encode(), digest_size=8).digest()
    return int.from_bytes(raw, "little") or 1  # 0 is the empty-slot mark
