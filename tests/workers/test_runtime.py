"""A worker process's own state: its server and its garbage collector once it is ready."""

from __future__ import annotations

import subprocess
import sys

import pytest

from fleetgen.settings import Settings
from workers.runtime import GC_GEN0_THRESHOLD, WorkerConfigError, server_url


def test_the_gpu_queue_names_the_server_unless_sglang_url_does() -> None:
    settings = Settings.from_env({})
    assert server_url(settings, ["gpu3", "shared"]) == settings.server_url_for_gpu(3)
    # A server over GPUs 2 and 3 listens on its lead GPU's port.
    assert server_url(settings, ["gpu2-3", "shared"]) == settings.server_url_for_gpu(2)
    assert server_url(Settings.from_env({"FLEETGEN_SERVER_URL": "http://gpu-box:30000"}),
                      ["gpu3"]) == "http://gpu-box:30000"
    for queues in (["shared"], ["gpu0", "gpu1"]):
        with pytest.raises(WorkerConfigError, match="exactly one gpuN queue"):
            server_url(settings, queues)


def test_a_ready_worker_freezes_what_it_built_and_collects_young_objects_less_often() -> None:
    # In a child: the collector's settings are process-wide.
    code = ("import gc; from workers.runtime import tune_gc; before = gc.get_freeze_count(); "
            "tune_gc(); print(before, gc.get_freeze_count(), *gc.get_threshold())")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True).stdout.split()
    before, frozen, young, older, oldest = map(int, out)
    assert before == 0 and frozen > 10_000  # the imports' objects are no longer scanned
    assert (young, older, oldest) == (GC_GEN0_THRESHOLD, 10, 10)
