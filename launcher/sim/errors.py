"""The simulator's error root (the tree: launcher/sim/__init__.py). The simulator imports
nothing of fleetgen outside launcher/sim/, so it does not share the launcher's root."""

from __future__ import annotations


class SimError(Exception):
    """Base of every error the simulator raises on purpose."""
