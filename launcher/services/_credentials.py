"""Secrets the embedded servers make for themselves, and the private places they keep them.

On a shared GPU node every local user can connect to 127.0.0.1 and read world-readable files,
so an embedded server is locked by default: its data dir is 0700, and its password (generated
at its first start) lives in a 0600 file in that dir, never on a command line (`ps` shows
those to everyone) nor in a log. Clients read the same file (FLEETGEN_REDIS_PASSWORD_FILE,
AWS_SHARED_CREDENTIALS_FILE), so a demo or a Procfile needs no password typed anywhere.

    private_dir(data_dir)                                        # mkdir -p, then chmod 0700
    text = read_or_create(data_dir / "password", lambda: new_secret() + "\\n")
"""

from __future__ import annotations

import contextlib
import os
import secrets
import tempfile
from collections.abc import Callable
from pathlib import Path

PRIVATE_DIR_MODE = 0o700
SECRET_FILE_MODE = 0o600
# 32 random bytes, url-safe: 256 bits, nothing that needs quoting in a URL or an INI file.
SECRET_BYTES = 32


def private_dir(path: Path) -> Path:
    """Create `path` (and its parents) and make it 0700, also when it already existed."""
    path.mkdir(parents=True, exist_ok=True, mode=PRIVATE_DIR_MODE)
    path.chmod(PRIVATE_DIR_MODE)
    return path


def new_secret() -> str:
    return secrets.token_urlsafe(SECRET_BYTES)


def write_private(path: Path, text: str) -> None:
    """Replace `path` atomically with `text`, mode 0600 from its first byte on."""
    tmp = _temp_with(path, text)
    try:
        os.replace(tmp, path)
    finally:
        Path(tmp).unlink(missing_ok=True)


def read_or_create(path: Path, make: Callable[[], str]) -> str:
    """The text of the secret file `path`; if there is none (or it is empty), `make()` written
    there first, mode 0600, in a 0700 dir.

    Creation is create-if-absent (a temp file hard-linked into place), so two processes racing
    at a first start agree on one secret. A secret file found readable by others is made 0600.
    """
    private_dir(path.parent)
    text = _read(path)
    if text:
        return text
    tmp = _temp_with(path, make())
    try:
        if text is None:
            # FileExistsError: another process won the race; use its secret.
            with contextlib.suppress(FileExistsError):
                os.link(tmp, path)
        else:  # an empty file: nobody can be using it
            os.replace(tmp, path)
    finally:
        Path(tmp).unlink(missing_ok=True)
    return _read(path) or ""


def _temp_with(path: Path, text: str) -> str:
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    with os.fdopen(fd, "w") as out:  # mkstemp creates it 0600
        out.write(text)
        out.flush()
        os.fsync(out.fileno())
    return tmp


def _read(path: Path) -> str | None:
    try:
        if path.stat().st_mode & 0o077:
            path.chmod(SECRET_FILE_MODE)
        return path.read_text().strip()
    except FileNotFoundError:
        return None
