"""The node's errors, under the launcher's root (the whole tree: launcher/__init__.py).

    NodeError           # the node cannot be brought up or controlled as asked
      ProfileError      # a bad profile file or server argument
      NoGpuError        # nvidia-smi missing or failed, or a requested index absent
      GpuSpecError      # a bad --gpus value, or GPUs that do not divide into whole servers
      OrderError        # a restart request the supervisor cannot carry out (_supervisor.py)

`launcher up|status|restart` print any LauncherError (a busy port is
`launcher.errors.PortBusyError`) as one `launcher CMD: ...` line, exit 2. An OrderError is
recorded in node.json as rejected, not raised to a command.
"""

from __future__ import annotations

from launcher.errors import LauncherError


class NodeError(LauncherError):
    """Base class: the node cannot be brought up or controlled as asked."""


class ProfileError(NodeError):
    """A profile file or server argument list the launcher cannot use."""


class NoGpuError(NodeError):
    """No usable NVIDIA GPU: nvidia-smi is missing or failed, or a requested index is absent."""


class GpuSpecError(NodeError):
    """A `--gpus` value that is not a list of indices and ranges (e.g. `0-6` or `0,1,4`), or
    GPUs that do not divide into servers of the size the parallelism flags give."""
