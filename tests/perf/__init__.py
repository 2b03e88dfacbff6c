"""The performance suite: keep every GPU slot busy, measured side by side
(docs/development/performance.md).

Run it with `python -m tests.perf`; it is not part of the pytest run (see conftest.py).
"""
