"""Bundled demo prompts (``sample.jsonl``) and the generator that writes them."""

from pathlib import Path

SAMPLE_PATH = Path(__file__).with_name("sample.jsonl")

__all__ = ["SAMPLE_PATH"]
