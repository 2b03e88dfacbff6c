"""Benchmarks are run by `python -m tests.perf`, never collected by pytest (they take minutes)."""

collect_ignore_glob = ["*.py"]
