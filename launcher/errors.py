"""The launcher's error root, and the one error its parts share (the tree: launcher/__init__.py).

`launcher.node` (NodeError and its subclasses) and the embedded services (ServiceError and its
subclasses, launcher.services) derive from `LauncherError`; a command catches
`LauncherError` and prints one line. `launcher.sim` stands apart: it imports nothing of the
launcher and has its own root (`SimError`).
"""

from __future__ import annotations


class LauncherError(Exception):
    """Base of every error the launcher raises on purpose."""


class PortBusyError(LauncherError):
    """A port a server must listen on is already taken: a GPU's SGLang server (its HTTP or
    NCCL port), the embedded Valkey or SeaweedFS."""
