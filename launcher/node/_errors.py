"""The node's error tree: one base class, one error per thing that failed.

    NodeError           # the node cannot be brought up or controlled as asked
      PortBusyError     # a port a server needs is taken
      ProfileError      # a bad profile file or server argument
      NoGpuError        # nvidia-smi missing or failed, or a requested index absent
      GpuSpecError      # a bad --gpus value

`launcher up|status|restart` print any NodeError as one `launcher CMD: ...` line, exit 2.
A restart request the supervisor cannot carry out is an `OrderError` (the supervisor's):
it is recorded in node.json as rejected, not raised to a command.
"""

from __future__ import annotations


class NodeError(Exception):
    """Base class: the node cannot be brought up or controlled as asked."""


class PortBusyError(NodeError):
    """A port a server must listen on is already taken."""


class ProfileError(NodeError):
    """A profile file or server argument list the launcher cannot use."""


class NoGpuError(NodeError):
    """No usable NVIDIA GPU: nvidia-smi is missing or failed, or a requested index is absent."""


class GpuSpecError(NodeError):
    """A `--gpus` value that is not a list of indices and ranges (e.g. `0-6` or `0,1,4`)."""
