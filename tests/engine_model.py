"""A real engine with no download: a random-weight Qwen3 and a byte-level BPE tokenizer made on
the spot, and the `transformers serve --continuous-batching` command that serves them.

    python -m tests.engine_model OUT --size micro --vocab 1000    # one JSON line: what it made
    argv = serve_argv(sys.executable, str(OUT), device="cpu", dtype="float32",
                      host="127.0.0.1", port="8000")    # run with serve_env(a folder)

tests/system/test_real_engine.py serves the `micro` shape on the CPU; tests/perf/real_engine.py
serves Qwen3-1.7B's shape on a GPU. The model is made by a child process, so the test suite's
own process never imports torch or transformers; and the benchmark imports this module on a
GPU machine's bare `python3` before its venv exists. Only the standard library is imported at
the top for both reasons: torch, transformers and tokenizers are imported in `make_model`.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import platform
import random
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

# Qwen3's shapes. `tiny` is the benchmark's CPU dry run; `micro` is the test suite's, small
# enough that a CPU decodes a few dozen short answers in seconds.
SHAPES: dict[str, dict[str, Any]] = {
    "1.7b": {"hidden_size": 2048, "num_hidden_layers": 28, "num_attention_heads": 16,
             "num_key_value_heads": 8, "head_dim": 128, "intermediate_size": 6144,
             "tie_word_embeddings": True},
    "tiny": {"hidden_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
             "num_key_value_heads": 2, "head_dim": 32, "intermediate_size": 256,
             "tie_word_embeddings": True},
    "micro": {"hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
              "num_key_value_heads": 2, "head_dim": 16, "intermediate_size": 128,
              "tie_word_embeddings": True},
}
SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
CHATML = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
# fleetgen's job defaults (docs/guides/input-format.md): the model's generation config, and
# what the benchmark's direct client asks, so that both clients ask the same.
TEMPERATURE, TOP_P = 0.6, 0.95
VOCAB = 32_000  # the benchmark's: a real tokenizer's order of magnitude (Qwen3 has 151,936)
CORPUS_LINES = 30_000  # ~2 s of BPE training; 20,000 lines already give the 32,000 tokens
MAX_POSITIONS = 4096
# `transformers serve` with its continuous-batching logger at INFO: that logger is not under
# `transformers` (`--log-level` leaves it at WARNING), and its INFO lines are what tell the KV
# cache's size, the max batch tokens and whether CUDA graphs are used.
SERVE = ("import logging, sys; "
         "logging.getLogger('ContinuousBatchingLogger').setLevel(logging.INFO); "
         "from transformers.cli.transformers import main; "
         "sys.argv[0] = 'transformers'; main()")
ENGINE_PACKAGES = ("torch", "transformers", "tokenizers", "fastapi", "uvicorn", "starlette",
                   "pydantic", "openai")


def make_model(out: Path, *, size: str, vocab: int = VOCAB, corpus_lines: int = CORPUS_LINES,
               device: str = "cpu", dtype: str = "float32") -> dict[str, Any]:
    """A byte-level BPE tokenizer of at most `vocab` tokens, trained here with a ChatML
    template, and a random-weight Qwen3 of shape `size`, saved with save_pretrained into `out`.
    Returns what was made: parameters, vocabulary, seconds, the folder's size, the versions."""
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import (
        AutoModelForCausalLM,
        GenerationConfig,
        PreTrainedTokenizerFast,
        Qwen3Config,
    )

    started = time.monotonic()
    out.mkdir(parents=True, exist_ok=True)
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab, special_tokens=list(SPECIAL_TOKENS),
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    bpe.train_from_iterator(corpus(corpus_lines), trainer=trainer)
    tok = PreTrainedTokenizerFast(  # type: ignore[no-untyped-call]
        tokenizer_object=bpe, eos_token="<|im_end|>", pad_token="<|endoftext|>")
    tok.chat_template = CHATML
    tok.model_max_length = MAX_POSITIONS
    tok.save_pretrained(out)
    tokenizer_s = time.monotonic() - started

    config = Qwen3Config(vocab_size=len(tok), max_position_embeddings=MAX_POSITIONS,
                         bos_token_id=None, eos_token_id=tok.eos_token_id,
                         pad_token_id=tok.pad_token_id, **SHAPES[size])
    torch.manual_seed(0)
    # Initialised where they will run: seconds, not minutes.
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(  # type: ignore[no-untyped-call]
            config, dtype=getattr(torch, dtype))
    model.generation_config = GenerationConfig(  # type: ignore[no-untyped-call]
        do_sample=True, temperature=TEMPERATURE, top_p=TOP_P, max_new_tokens=1024,
        eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    model.save_pretrained(out)
    return {"size": size, "params": sum(p.numel() for p in model.parameters()),
            "vocab": len(tok), "dtype": dtype, "shape": SHAPES[size],
            "eos_token_id": tok.eos_token_id, "tokenizer_s": round(tokenizer_s, 1),
            "total_s": round(time.monotonic() - started, 1),
            "folder_mb": round(sum(f.stat().st_size for f in out.iterdir()) / 1e6, 1),
            "engine": {"python": platform.python_version(), **package_versions(ENGINE_PACKAGES),
                       "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available()
                       else None}}


def corpus(lines: int) -> Iterator[str]:
    """Generated text of made-up words, punctuation and numbers: enough merges for 32k."""
    rnd = random.Random(0)
    syllables = [c + v + t for c in "bcdfghjklmnprstvwz" for v in "aeiouy" for t in ("", "n", "r")]
    words = ["".join(rnd.choice(syllables) for _ in range(rnd.randint(1, 4)))
             for _ in range(50_000)]
    for _ in range(lines):
        parts = [rnd.choice(words) for _ in range(rnd.randint(5, 30))]
        if rnd.random() < 0.3:
            parts.append(str(rnd.randint(0, 99_999)))
        yield " ".join(parts) + rnd.choice((".", "?", "!", ",", ";", ""))


def serve_argv(python: Path | str, model: str, *, device: str, dtype: str, host: str,
               port: str) -> list[str]:
    """`transformers serve MODEL --continuous-batching` on `device`, run by `python` through
    `SERVE` (its batching logger at INFO). The served model's name is `model` exactly: the
    server refuses any other (HTTP 400). The launcher's profile passes its placeholders."""
    return [str(python), "-c", SERVE, "serve", model, "--continuous-batching",
            "--device", device, "--dtype", "auto" if dtype == "float32" else dtype,
            "--host", host, "--port", port]


def serve_env(hub_cache: Path) -> dict[str, str]:
    """The server's environment: offline, and an empty hub cache in `hub_cache`, made here
    (`/v1/models` lists the cache; a missing one answers HTTP 500)."""
    hub_cache.mkdir(parents=True, exist_ok=True)
    return {"HF_HUB_OFFLINE": "1", "HF_HUB_DISABLE_UPDATE_CHECK": "1",
            "HF_HUB_CACHE": str(hub_cache), "PYTHONUNBUFFERED": "1"}


def package_versions(names: tuple[str, ...]) -> dict[str, str | None]:
    """Each installed distribution's version, None where it is not installed."""
    found: dict[str, str | None] = {}
    for name in names:
        try:
            found[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            found[name] = None
    return found


def main(argv: list[str] | None = None) -> int:
    """Make the model and its tokenizer in OUT; print what was made as one JSON line."""
    p = argparse.ArgumentParser(prog="python -m tests.engine_model",
                                description="A random-weight Qwen3 and its tokenizer, made here.")
    p.add_argument("out", type=Path, help="folder to save the model and its tokenizer in")
    p.add_argument("--size", choices=sorted(SHAPES), default="micro", help="Qwen3 shape")
    p.add_argument("--vocab", type=int, default=VOCAB, help="most tokens the BPE learns")
    p.add_argument("--corpus-lines", type=int, default=CORPUS_LINES,
                   help="lines of made-up text the BPE is trained on")
    p.add_argument("--device", default="cpu", help="where the weights are initialised")
    p.add_argument("--dtype", default="float32", help="the weights' torch dtype")
    a = p.parse_args(argv)
    info = make_model(a.out, size=a.size, vocab=a.vocab, corpus_lines=a.corpus_lines,
                      device=a.device, dtype=a.dtype)
    print(json.dumps(info), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
