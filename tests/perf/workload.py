"""The benchmark workload: simulated B200 servers and the prompts sent to them.

Calibrated from a real run (one B200, a 27B hybrid thinking model with speculative decoding):
40 requests run at once, each decodes ~86 tokens/s (~3,450 tokens/s per full GPU), prompts are
~260 tokens and answers are heavy-tailed (lognormal) with a mean of ~2,400 tokens, capped by
max_tokens. `speed` compresses time so a run of a few thousand prompts takes about a minute.

Every prompt has exactly `input_tokens` prompt tokens as the simulator counts them, so the
tokens generated so far can be read exactly from a server's /metrics at any instant:
`generation_tokens_total + num_used_tokens - input_tokens * num_running_reqs`.

    wl = Workload(prompts=5000)
    wl.write_prompts(path)          # JSONL, ids p000000.., "Prompt p000123." in each text
    wl.sim_flags()                  # flags of one simulated server
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

import orjson

from launcher.sim import tokenizer

SYSTEM = "You are a careful assistant. Think step by step, then answer."
# The recording simulator finds the prompt id in the request text with this pattern.
ID_PATTERN = re.compile(rb"Prompt (p\d{6})\.")
_WORDS = ("river", "market", "theory", "signal", "garden", "engine", "winter", "ledger",
          "harbor", "pattern", "crystal", "orbit", "meadow", "circuit", "lantern", "canyon")


def prompt_id(n: int) -> str:
    """The id of prompt number n (also written into its text)."""
    return f"p{n:06d}"


@dataclass(frozen=True)
class Workload:
    """One benchmark's fleet and prompts (defaults: the calibrated B200 fleet, 4 GPUs)."""

    prompts: int = 5000
    servers: int = 4
    slots: int = 40
    decode_tps: float = 86.0
    input_tokens: int = 260
    mean_output_tokens: float = 2400.0
    output_sigma: float = 0.8
    max_tokens: int = 16384
    # 5,000 answers x 2,400 tokens / (4 x 40 x 86 x 15 tokens/s) = 58 s of full servers.
    speed: float = 15.0
    seed: int = 0

    @property
    def slot_rate(self) -> float:
        """Output tokens/s of one running request, in wall-clock time."""
        return self.decode_tps * self.speed

    @property
    def ideal_rate(self) -> float:
        """Output tokens/s of the whole fleet with every slot busy."""
        return self.servers * self.slots * self.slot_rate

    def sim_flags(self) -> list[str]:
        """Flags of one simulated server of this fleet."""
        return ["--max-running-requests", str(self.slots), "--decode-tps", str(self.decode_tps),
                "--mean-output-tokens", str(self.mean_output_tokens),
                "--output-sigma", str(self.output_sigma), "--speed", str(self.speed),
                "--seed", str(self.seed), "--log-level", "warning"]

    def line(self, n: int) -> bytes:
        """Prompt n as one JSONL line (chat shape, its own id, no sampling overrides)."""
        user = self._user_text(n)
        messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": user}]
        return orjson.dumps({"id": prompt_id(n), "messages": messages},
                            option=orjson.OPT_APPEND_NEWLINE)

    def write_prompts(self, path: Path) -> Path:
        """Write all prompts to `path` (JSONL) and return it."""
        with path.open("wb") as out:
            for start in range(0, self.prompts, 10_000):
                stop = min(self.prompts, start + 10_000)
                out.write(b"".join(self.line(n) for n in range(start, stop)))
        return path

    def _user_text(self, n: int) -> str:
        text = f"Prompt {prompt_id(n)}. Write about"
        # One word is one token for the simulator's tokenizer: pad to the exact count.
        missing = self.input_tokens - tokenizer.chat_prompt_tokens([SYSTEM, text], None, True)
        if missing < 0:
            raise ValueError(f"input_tokens={self.input_tokens} is below the fixed text's size")
        words = [_WORDS[(n * 7 + i * 3) % len(_WORDS)] for i in range(missing)]
        return text + "".join(" " + w for w in words)
