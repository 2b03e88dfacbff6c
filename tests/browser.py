"""Headless Chromium for tests that look at a page as a person would (Flower, `producer report`).

The `chromium` fixture is in tests/conftest.py.
"""

from __future__ import annotations

import os
import re
import subprocess
import tempfile
from pathlib import Path

CHROMIUM = "/usr/bin/chromium"
CHROMIUM_FLAGS = ("--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                  "--disable-background-networking", "--disable-component-update", "--disable-sync")


class Browser:
    """Headless Chromium, one throwaway profile per run, HOME kept inside the test's tmp dir."""

    def __init__(self, home: Path) -> None:
        self.home = home
        # Chromium writes ~/.config/chromium and ~/.cache/dconf even with --user-data-dir.
        self.env = {**os.environ, "HOME": str(home), "XDG_CONFIG_HOME": str(home / ".config"),
                    "XDG_CACHE_HOME": str(home / ".cache")}

    def run(self, *args: str) -> str:
        profile = tempfile.mkdtemp(dir=self.home)
        result = subprocess.run(
            [CHROMIUM, *CHROMIUM_FLAGS, f"--user-data-dir={profile}", *args],
            env=self.env, capture_output=True, text=True, timeout=60, check=False,
        )
        assert result.returncode == 0, result.stderr[-3000:]
        return result.stdout

    def dom(self, url: str) -> str:
        """The page's DOM after its scripts ran (5 s of virtual time: ajax tables filled)."""
        dom = self.run("--virtual-time-budget=5000", "--dump-dom", url)
        # Kept for the failure message's reader: tmp/chromium-home/<page>.html.
        page = re.sub(r"\W+", "_", url.split("@")[-1].split("/", 1)[-1]) or "root"
        (self.home / f"{page}.html").write_text(dom)
        return dom

    def screenshot(self, url: str, path: Path) -> Path:
        self.run("--virtual-time-budget=5000", "--window-size=1400,900", f"--screenshot={path}", url)
        assert path.stat().st_size > 10_000, f"{path} looks empty"
        return path
