"""`python -m launcher explain LOGFILE [--json]`: what an SGLang log says about its server.

Streams the log through `logparse.parse_line` and folds the events into a `LogReport`: format
era, model, memory pools, requested vs effective max_running_requests and why, readiness,
the latest Decode batch, and the fatal error with a hint. Exit codes: 0 normally, 1 when the
log shows a fatal error, 2 on bad usage or an unreadable file.
"""

from __future__ import annotations

import argparse
import json
import sys

from launcher.hints import HINTS
from launcher.logreport import LogReport, fold, read_log
from launcher.textreport import render_text

# Re-exported: server.py imports HINTS and LogReport from here, the README imports read_log.
__all__ = ["EXIT_FATAL", "EXIT_OK", "EXIT_USAGE", "HINTS", "LogReport", "fold", "main",
           "read_log", "render_text"]

EXIT_OK, EXIT_FATAL, EXIT_USAGE = 0, 1, 2


def main(argv: list[str] | None = None) -> int:
    """Entry point of `python -m launcher explain LOGFILE [--json]`; returns the exit code."""
    parser = argparse.ArgumentParser(
        prog="python -m launcher explain",
        description="Explain what an SGLang server log says about its server.",
        epilog="examples:\n  python -m launcher explain logs/gpu0.log\n"
        "  python -m launcher explain logs/gpu0.log --json | jq .max_running_requests",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("logfile", help="an SGLang server log (stdout and stderr merged)")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:  # argparse exits 2 on bad usage, 0 on --help
        return exc.code if isinstance(exc.code, int) else EXIT_USAGE
    try:
        report = read_log(args.logfile)
    except OSError as exc:
        print(f"explain: cannot read {args.logfile}: {exc.strerror or exc}", file=sys.stderr)
        return EXIT_USAGE
    data = report.to_json()
    print(json.dumps(data, indent=2) if args.json else render_text(data))
    return EXIT_FATAL if data["fatal"] is not None else EXIT_OK
