"""The performance suite: keep every GPU slot busy, measured side by side (README "Performance suite").

Run it with `python -m tests.perf`; it is not part of the pytest run (see conftest.py).
"""
