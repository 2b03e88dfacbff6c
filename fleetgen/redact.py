"""Secrets out of anything fleetgen shows to people: `redact` is the one function for it.

Every error path, log line and status field that may carry a URL or a setting passes it through
`redact`. It masks the password of each URL's userinfo (`redis://:***@host:6389/0`), the values
of secret-looking query parameters (`?token=***`, S3 presigned `X-Amz-Signature=***`), and the
whole value of a setting whose name says it is a secret (`FLEETGEN_SERVER_API_KEY`, `*_PASSWORD`, ...):

    redact("cannot reach redis://:hunter2@10.0.0.5:6379/0")
        -> "cannot reach redis://:***@10.0.0.5:6379/0"
    redact("abc123", name="AWS_SECRET_ACCESS_KEY")  -> "***"

A command line (a server's argv in the launcher's log and state file) goes through
`redact_argv`, which applies the same rules to each flag and value:

    redact_argv(["--api-key", "k", "--port", "30000"]) -> ["--api-key", "***", "--port", "30000"]

Hosts, ports, paths and user names stay: they are what a person needs to find the fault.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from urllib.parse import parse_qsl, urlencode

MASK = "***"

# scheme://[userinfo@]rest-of-url, up to whitespace, a quote or a closing bracket.
_URL = re.compile(r"(?P<scheme>[A-Za-z][A-Za-z0-9+.\-]*://)(?P<rest>[^\s'\"<>)\]}]+)")
# A name holds a secret when one of its words (split at - _ . and spaces) is one of these:
# `--api-key`, `FLEETGEN_SERVER_API_KEY`, `--ssl-keyfile-password`, `X-Amz-Signature`, `FLOWER_BASIC_AUTH`
# do; `--tokenizer-path`, `max_tokens`, `--ssl-keyfile` do not.
_SECRET_WORDS = frozenset({"password", "passwd", "pass", "pwd", "secret", "token", "key", "auth",
                           "authorization", "signature", "credential", "apikey"})
# The public half of a key pair.
_NOT_SECRET = frozenset({"aws_access_key_id", "access_key_id", "key_id"})
_WORD = re.compile(r"[-_.\s]+")


def redact(value: object, *, name: str = "") -> str:
    """`value` as text a person may see: credentials in URLs masked, a secret setting all masked.

    `name` is the setting's name when there is one (an environment variable, a flag, a field).
    """
    text = "" if value is None else str(value)
    if name and is_secret_name(name) and text:
        return MASK
    return _URL.sub(_redact_url, text)


def is_secret_name(name: str) -> bool:
    """Whether a setting, flag, header or query parameter of this name holds a secret."""
    words = [w for w in _WORD.split(name.lower().strip("-")) if w]
    if "_".join(words).endswith(tuple(_NOT_SECRET)):
        return False
    return any(word in _SECRET_WORDS for word in words)


def redact_argv(argv: Sequence[str]) -> list[str]:
    """`argv` for people: the value of a secret-named flag (`--api-key K`, `--api-key=K`,
    `--ssl-keyfile-password K`) masked, and credentials in any URL among the words masked."""
    out = [redact(word) for word in argv]
    for i, word in enumerate(argv):
        if not word.startswith("--"):
            continue
        name, eq, value = word.partition("=")
        if not is_secret_name(name):
            continue
        if eq:
            out[i] = f"{name}={MASK}" if value else word
        # A secret flag's value is the next word, unless that is the next flag (a bare switch).
        elif i + 1 < len(argv) and not argv[i + 1].startswith("--"):
            out[i + 1] = MASK
    return out


def _redact_url(match: re.Match[str]) -> str:
    scheme, rest = match.group("scheme"), match.group("rest")
    authority_end = len(rest)
    for sep in "/?#":
        at = rest.find(sep)
        if at != -1:
            authority_end = min(authority_end, at)
    authority, tail = rest[:authority_end], rest[authority_end:]
    if "@" in authority:
        userinfo, host = authority.rsplit("@", 1)
        user, has_password, _ = userinfo.partition(":")
        # A lone userinfo (`http://TOKEN@host`) is a credential as much as a password is.
        authority = f"{user}:{MASK}@{host}" if has_password else f"{MASK}@{host}"
    path, has_query, query = tail.partition("?")
    if has_query:
        fragment = ""
        if "#" in query:
            query, fragment = query.split("#", 1)
            fragment = "#" + fragment
        pairs = parse_qsl(query, keep_blank_values=True)
        if pairs:
            masked = [(k, MASK if is_secret_name(k) else v) for k, v in pairs]
            query = urlencode(masked, safe="*:/")
        tail = f"{path}?{query}{fragment}"
    return f"{scheme}{authority}{tail}"
