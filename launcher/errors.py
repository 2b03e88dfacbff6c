"""The launcher's error tree: one base class, one error per thing that failed.

`gpus.py` and `profile.py` add their own:

    NodeError
      PortBusyError     # a port a server needs is taken
      ProfileError      # a bad profile file (profile.py) or server argument
      NoGpuError        # gpus.py: nvidia-smi missing or failed, index absent
      GpuSpecError      # gpus.py: a bad --gpus value
"""

from __future__ import annotations


class NodeError(Exception):
    """Base class: the node cannot be brought up or controlled as asked."""


class PortBusyError(NodeError):
    """A port a server must listen on is already taken."""


class ProfileError(NodeError):
    """A profile file or server argument list the launcher cannot use."""
