"""Regenerate launcher/node/sglang_flags.json from SGLang wheels.

    pip download sglang==0.5.23 --no-deps -d ~/.cache/fleetgen/sglang-wheels   # per release
    python scripts/sglang_flags.py ~/.cache/fleetgen/sglang-wheels

Reads every `sglang-X-*.whl` in the folder (one per release; post-releases are skipped, the
table keys are releases) with `ast`, and rewrites the table. tests/launcher/node/test_flags.py
compares the checked-in file with what this produces when SGLANG_WHEELS names the folder.
"""

from __future__ import annotations

import sys
from pathlib import Path

from launcher.node import SGLANG_FLAGS_FILE, read_wheel, table_json, wheel_release


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print("usage: python scripts/sglang_flags.py WHEEL_DIR", file=sys.stderr)
        return 2
    wheels = {wheel_release(p): p for p in sorted(Path(argv[0]).glob("sglang-*.whl"))}
    tables = {release: read_wheel(path) for release, path in wheels.items() if release}
    if not tables:
        print(f"error: {argv[0]}: no sglang-X-*.whl wheels", file=sys.stderr)
        return 1
    SGLANG_FLAGS_FILE.write_text(table_json(tables), encoding="utf-8")
    print(f"{SGLANG_FLAGS_FILE}: {len(tables)} releases, {min(map(len, tables.values()))}-"
          f"{max(map(len, tables.values()))} flags each")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
