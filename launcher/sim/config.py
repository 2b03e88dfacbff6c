"""SimConfig: every simulator setting, parsed from SGLang-like flags.

Each field carries its own flag spelling and help text, so the argparse parser, the defaults
and the docs cannot drift apart. Precedence is flag > environment > default; the only
environment variable read is `SGL_FORCE_SHUTDOWN` (SGLang's own, see
docs/reference/sglang.md#process).

    cfg = SimConfig.from_argv(["--port", "0", "--max-running-requests", "8", "--speed", "100"])
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
from dataclasses import dataclass, field
from typing import Any

from launcher.sim.errors import SimError
from launcher.sim.hang import HANGS
from launcher.sim.stress import Window, WindowError, check_switches
from launcher.sim.wording import WORDINGS

# The command a user types: `--help` and a flag error name it. The flags are SGLang's, and
# a flag error still exits 2 as SGLang's argparse does.
PROG = "python -m launcher sim"
DEFAULT_CONTEXT_LENGTH = 40960  # Qwen3's config.json max_position_embeddings
LOG_FORMATS = ("r", "2026-01", "2025-10", "2025-07", "2025-06")
# Which server's HTTP API is imitated (docs/development/simulator.md#other-engines): SGLang,
# vLLM's OpenAI-compatible server, or a strict OpenAI-schema server like `transformers serve`.
FLAVORS = ("sglang", "vllm", "strict")
OVERLOADS = ("queue", "429", "503")
NONE_WORDS = ("none", "")  # `--reasoning-parser none` turns a sim default parser off


class ConfigError(SimError, ValueError):
    """A flag value the simulator cannot run with (argparse reports it and exits 2)."""


def _opt(default: Any, help_: str, *flags: str, **argparse_kw: Any) -> Any:
    return field(default=default, metadata={"help": help_, "flags": flags, "kw": argparse_kw})


def _json_dict(text: str) -> dict[str, Any]:
    value = json.loads(text)
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError("expected a JSON object")
    return value


def _optional_parser(text: str) -> str | None:
    return None if text.lower() in NONE_WORDS else text


@dataclass(frozen=True)
class SimConfig:
    """Settings of one simulated SGLang server; defaults equal the CLI defaults."""

    # SGLang flags (docs/reference/sglang.md#flags), accepted so the launcher can pass its
    # command line through.
    model_path: str = _opt("sim/Qwen3.6-27B", "model id; only echoed", "--model-path", "--model")
    tokenizer_path: str | None = _opt(None, "echoed in /model_info")
    served_model_name: str | None = _opt(None, "name in /v1/models and metric labels")
    host: str = _opt("127.0.0.1", "HTTP bind host")
    port: int = _opt(30000, "HTTP port; 0 picks a free one", type=int)
    tp_size: int = _opt(1, "GPUs the weights are split over; their memory holds the KV pool; "
                        ">1 adds TP0 prefixes", "--tp-size", "--tensor-parallel-size", type=int)
    dp_size: int = _opt(1, "data-parallel ranks, each with its own pools and running cap "
                        "(/server_info lists one internal state per rank)", "--dp-size",
                        "--data-parallel-size", type=int)
    pp_size: int = _opt(1, "pipeline stages: like --tp-size for memory", "--pp-size",
                        "--pipeline-parallel-size", type=int)
    enable_dp_attention: bool = _opt(False, "the DP ranks share the --tp-size GPUs (each rank's "
                                     "pools on tp/dp of them)", action="store_true")
    context_length: int | None = _opt(None, "context length (model default 40960)", type=int)
    mem_fraction_static: float | None = _opt(None, "KV budget fraction (auto 0.841)", type=float)
    max_running_requests: int | None = _opt(None, "requested running cap (§7)", type=int)
    max_queued_requests: int | None = _opt(None, "waiting-queue cap; beyond it 503 (--overload "
                                           "429: 429)", type=int)
    max_total_tokens: int | None = _opt(None, "cap on the KV pool in tokens", type=int)
    chunked_prefill_size: int = _opt(8192, "echoed in the summary line", type=int)
    max_prefill_tokens: int = _opt(16384, "echoed in the summary line", type=int)
    reasoning_parser: str | None = _opt("qwen3", "reasoning parser ('none' disables)",
                                        type=_optional_parser)
    tool_call_parser: str | None = _opt("qwen25", "tool-call parser ('none' disables)",
                                        type=_optional_parser)
    enable_metrics: bool = _opt(True, "serve /metrics (on by default in the sim)",
                                action="store_true")
    decode_log_interval: int = _opt(40, "Decode line every N decode iterations", type=int)
    log_level: str = _opt("info", "level of the SGLang-style lines")
    log_level_http: str | None = _opt(None, "uvicorn level (default: --log-level)")
    nccl_port: int | None = _opt(None, "echoed", type=int)
    mamba_radix_cache_strategy: str = _opt(
        "auto", "hybrid prefix-cache strategy (§7)",
        choices=("auto", "no_buffer", "extra_buffer", "extra_buffer_lazy"))
    max_mamba_cache_size: int | None = _opt(None, "Mamba state slots (auto-fit: 80)", type=int)
    mamba_full_memory_ratio: float = _opt(0.9, "mamba/KV memory ratio", type=float)
    mamba_ssm_dtype: str = _opt("float32", "state dtype; bfloat16 doubles the slots",
                                choices=("float32", "bfloat16", "float16"))
    disable_radix_cache: bool = _opt(False, "Mamba ratio 1 (§7)", action="store_true")
    speculative_algorithm: str | None = _opt(None, "e.g. EAGLE, NEXTN (upper-cased)")
    speculative_num_steps: int | None = _opt(None, "draft steps (auto 3)", type=int)
    speculative_eagle_topk: int | None = _opt(None, "draft top-k (auto 1)", type=int)
    speculative_num_draft_tokens: int | None = _opt(None, "verify width (auto 4)", type=int)
    speculative_draft_model_path: str | None = _opt(None, "echoed",
                                                    "--speculative-draft-model-path",
                                                    "--speculative-draft-model")
    api_key: str | None = _opt(None, "require `Authorization: Bearer KEY`")
    kv_cache_dtype: str = _opt("auto", "echoed")
    load_format: str = _opt("auto", "echoed")
    trust_remote_code: bool = _opt(False, "echoed", action="store_true")
    skip_server_warmup: bool = _opt(False, "no warmup request at start", action="store_true")
    watchdog_timeout: float = _opt(300.0, "echoed", type=float)
    base_gpu_id: int = _opt(0, "echoed", type=int)
    cuda_graph_max_bs_decode: int | None = _opt(None, "largest CUDA-graph batch", type=int)
    allow_auto_truncate: bool = _opt(False, "clamp instead of the context 400",
                                     action="store_true")
    enable_cache_report: bool = _opt(False, "usage.prompt_tokens_details", action="store_true")
    default_chat_template_kwargs: dict[str, Any] | None = _opt(  # noqa: RUF009 (a field())
        None, "JSON, e.g. '{\"enable_thinking\": false}'", type=_json_dict)
    # Simulator flags.
    model_arch: str = _opt("dense", "the architecture it serves, which sets its capacity model "
                           "(§7) and the model class it reports", choices=("dense", "mamba-hybrid"))
    decode_tps: float = _opt(86.0, "tokens/s of one running request (--decode-model fixed)",
                             type=float)
    decode_model: str = _opt(
        "fixed", "fixed: every running request decodes at --decode-tps; step: a decode step "
        "costs --step-ms + --step-ms-per-request x running and yields one token per request "
        "(the accept length with speculative decoding)", choices=("fixed", "step"))
    step_ms: float = _opt(11.0, "fixed cost of one decode step (--decode-model step)",
                          type=float)
    step_ms_per_request: float = _opt(0.56, "cost of one running request in a decode step",
                                      type=float)
    prefill_tps: float = _opt(20000.0, "prompt tokens/s of one request's prefill", type=float)
    mean_output_tokens: float = _opt(1000.0, "mean natural answer length", type=float)
    output_sigma: float = _opt(0.8, "lognormal sigma of answer lengths", type=float)
    speed: float = _opt(1.0, "time compression: rates are multiplied by it", type=float)
    instant: bool = _opt(False, "no prefill/decode time at all", action="store_true")
    seed: int = _opt(0, "changes every deterministic draw", type=int)
    mode: str = _opt("normal", "thinking-off: ignore enable_thinking, boilerplate answers",
                     choices=("normal", "thinking-off"))
    boilerplate_rate: float = _opt(0.87, "share of 'OK.' answers in thinking-off mode",
                                   type=float)
    tool_call_rate: float = _opt(0.5, "share of answers that call a tool when tools given",
                                 type=float)
    # A program's tool loop (call, run, answer) must end even when the model keeps calling.
    # 3: a program sees several rounds and then the end, and a test that reaches it is short.
    max_tool_turns: int = _opt(3, "an answer calls no tool once the conversation holds N tool "
                               "results (role tool), whatever tool_choice says; 0: never calls",
                               type=int, metavar="N")
    speculative_accept_length: float = _opt(3.2, "accept len shown with spec", type=float)
    speculative_accept_rate: float | None = _opt(None, "accept rate (default from length)",
                                                 type=float)
    log_format: str = _opt("r", "era of the batch log lines", choices=LOG_FORMATS)
    tp_prefix: bool = _opt(False, "emit ' TP0' in scheduler line prefixes", action="store_true")
    access_log: bool = _opt(False, "uvicorn access lines (costly at high rates)",
                            action="store_true")
    load_delay: float = _opt(0.0, "seconds 'loading weights' before the port opens", type=float)
    startup_delay: float = _opt(0.0, "seconds /health answers 503 after the port opens",
                                type=float)
    health_latency: float = _opt(0.0, "seconds each healthy /health takes", type=float)
    fail_rate: float = _opt(0.0, "share of requests answered --fail-status", type=float)
    fail_status: int = _opt(500, "what --fail-rate answers: 500, or 502/504 as a proxy would",
                            type=int)
    overload: str = _opt("queue", "a request that finds the running slots and the waiting queue "
                         "(--max-queued-requests, 0 unless set) full: queue it anyway "
                         "(SGLang's default), or refuse it with 429 + Retry-After (TGI, "
                         "routers) or SGLang's 503", choices=OVERLOADS)
    retry_after: int = _opt(5, "Retry-After seconds of a 429 (0: no header)", type=int)
    error_window: tuple[str, ...] = _opt(
        (), "START:SECONDS:STATUS[:chat|all]: from START s after the server is ready, for "
        "SECONDS (wall clock, not scaled by --speed), answer STATUS at once (chat: the "
        "generation routes, /health stays 200; all: every route); repeatable",
        action="append")
    fail_prompt: tuple[str, ...] = _opt((), "rid prefix or content marker → context 400",
                                        action="append")
    hang: str | None = _opt(None, "generation requests are taken and never answered (chat: "
                            "nothing is sent; partial: the status, headers and half the body), "
                            "while /health and the other routes answer", choices=HANGS)
    wording: str | None = _opt(None, "whose words refuse a prompt or a max_tokens that does not "
                               "fit the context (default: the flavour's own)", choices=WORDINGS)
    error_request_ids: bool = _opt(False, "every JSON error message ends with "
                                   "' (request id req_<13 hex>)', new for each request",
                                   action="store_true")
    poison: tuple[str, ...] = _opt((), "a chat request with MARKER in any message is answered "
                                   "the flavour's 500, every time; repeatable",
                                   action="append", metavar="MARKER")
    rpm: int | None = _opt(None, "at most N generation requests per rolling minute: OpenAI's "
                           "x-ratelimit-* headers on every answer, its 429 beyond", type=int,
                           metavar="N")
    crash_after_requests: int | None = _opt(None, "die (-9) on receiving request N+1",
                                            type=int)
    crash_after_seconds: float | None = _opt(None, "die (-9) T s after ready", type=float)
    startup_oom: bool = _opt(False, "die (-9) at start with SGLang's OOM", action="store_true")
    force_shutdown: bool = _opt(False, "SIGTERM exits at once (env SGL_FORCE_SHUTDOWN=1)",
                                action="store_true")
    sglang_version: str = _opt("0.5.23", "the `version` /server_info reports")
    flavor: str = _opt("sglang", "whose HTTP API to imitate: sglang, vllm (vLLM 0.11.0's OpenAI "
                       "server) or strict (an OpenAI-schema server like `transformers serve`)",
                       choices=FLAVORS)
    abort_rate: float = _opt(0.0, "share of chat requests that end early with finish_reason "
                             "abort (HTTP 200, partial output)", type=float)
    # Embedding mode: SGLang's --is-embedding; vLLM's `--runner pooling` sets the same field.
    is_embedding: bool = _opt(False, "serve an embedding model: /v1/embeddings answers, the "
                              "generation routes answer the engine's error (--flavor vllm: "
                              "`--runner pooling`)", action="store_true")
    # 1024: Qwen3-Embedding-0.6B's hidden size
    embedding_dim: int = _opt(1024, "length of an embedding vector (the model's hidden size)",
                              type=int, metavar="N")
    matryoshka: bool = _opt(False, "the embedding model supports `dimensions` (Matryoshka); "
                            "without it a request with `dimensions` is the engine's 400",
                            action="store_true")
    # SGLang's default id2label names; one label is a reward model (a score per text).
    labels: str = _opt("LABEL_0,LABEL_1", "the classifier's labels (its id2label), comma-"
                       "separated: on an embedding server /v1/classify (--flavor vllm: "
                       "/classify) answers one of them per text", metavar="A,B,...")
    embedding_tps: float = _opt(100000.0, "prompt tokens/s of an embedding forward (all the "
                                "sequences admitted together run as one forward)", type=float)
    embedding_step_ms: float = _opt(4.0, "fixed cost of one embedding forward", type=float)
    vllm_version: str = _opt("0.11.0", "the `version` /version reports (--flavor vllm)")
    # vLLM 0.11.0 names it reasoning_content; later releases renamed it reasoning (PR 27752)
    vllm_reasoning_field: str = _opt(
        "reasoning_content", "message field of the separated reasoning (--flavor vllm)",
        choices=("reasoning_content", "reasoning"))

    def __post_init__(self) -> None:
        positive = {"speed": self.speed, "decode_tps": self.decode_tps,
                    "prefill_tps": self.prefill_tps, "mean_output_tokens": self.mean_output_tokens,
                    "step_ms": self.step_ms, "embedding_tps": self.embedding_tps,
                    "embedding_dim": self.embedding_dim}
        for name, value in positive.items():
            if not value > 0:
                raise ConfigError(f"--{name.replace('_', '-')} must be > 0, got {value}")
        for name in ("fail_rate", "abort_rate", "boilerplate_rate", "tool_call_rate"):
            if not 0.0 <= getattr(self, name) <= 1.0:
                raise ConfigError(f"--{name.replace('_', '-')} must be within [0, 1]")
        if self.max_tool_turns < 0:
            raise ConfigError(f"--max-tool-turns must be >= 0, got {self.max_tool_turns}")
        if self.embedding_step_ms < 0:
            raise ConfigError("--embedding-step-ms must be >= 0")
        if not all(self.label_names):
            raise ConfigError(f"--labels: a comma-separated list of names, got {self.labels!r}")
        if self.is_embedding and self.flavor == "strict":
            raise ConfigError("--is-embedding: the strict flavour has no /v1/embeddings")
        if self.step_ms_per_request < 0:
            raise ConfigError("--step-ms-per-request must be >= 0")
        if self.decode_log_interval < 1:
            raise ConfigError("--decode-log-interval must be >= 1")
        if self.context_length is not None and self.context_length < 16:
            raise ConfigError("--context-length must be >= 16")
        if min(self.tp_size, self.dp_size, self.pp_size) < 1:
            raise ConfigError("--tp-size, --dp-size and --pp-size must be >= 1")
        self._check_stress()
        if self.enable_dp_attention and self.tp_size % self.dp_size:
            raise ConfigError("--enable-dp-attention: --dp-size must divide --tp-size")

    def _check_stress(self) -> None:
        """The flags of a server under stress (stress.py)."""
        if self.max_queued_requests is not None and self.max_queued_requests < 0:
            raise ConfigError(f"--max-queued-requests must be >= 0, got {self.max_queued_requests}")
        if self.overload not in OVERLOADS:
            raise ConfigError(f"--overload must be one of {', '.join(OVERLOADS)}, "
                              f"got {self.overload!r}")
        if not 400 <= self.fail_status <= 599:
            raise ConfigError(f"--fail-status must be a 4xx or 5xx status, got {self.fail_status}")
        if self.retry_after < 0:
            raise ConfigError(f"--retry-after must be >= 0 seconds, got {self.retry_after}")
        try:
            for window in self.error_window:
                Window.parse(window)
        except WindowError as exc:
            raise ConfigError(str(exc)) from None
        try:
            check_switches(self.hang, self.wording, self.error_request_ids, self.poison,
                           self.rpm)
        except WindowError as exc:  # its message starts with the switch's name
            raise ConfigError(f"--{exc}") from None

    @property
    def served_name(self) -> str:
        """The name in /v1/models, metric labels and the default `model` echo."""
        return self.served_model_name or self.model_path

    @property
    def context_len(self) -> int:
        """The context length in force (the model's default unless given)."""
        return self.context_length or DEFAULT_CONTEXT_LENGTH

    @property
    def rank_gpus(self) -> int:
        """The GPUs one DP rank's pools live on: its tensor-parallel group (tp/dp of the
        server's with DP attention, whose ranks share the GPUs) times the pipeline stages."""
        attention_tp = self.tp_size // self.dp_size if self.enable_dp_attention else self.tp_size
        return attention_tp * self.pp_size

    @property
    def speculative(self) -> bool:
        """Whether speculative decoding is configured."""
        return self.speculative_algorithm is not None

    def decode_rate(self, running: int) -> float:
        """Tokens/s of one running request when `running` share the batch (speed applied).

        `step`: memory-bound decode, one step costs a + b x running and yields the accept
        length per request; calibrated on the reference GPU (docs/development/simulator.md):
        16 running give ~2,300 tokens/s in all, 40 running ~3,455.
        """
        if self.instant:
            return math.inf
        if self.decode_model == "fixed":
            return self.decode_tps * self.speed
        per_step = self.speculative_accept_length if self.speculative else 1.0
        step_s = (self.step_ms + self.step_ms_per_request * max(1, running)) / 1000.0
        return per_step / step_s * self.speed

    @property
    def label_names(self) -> list[str]:
        """--labels as a list: the classifier's classes, in id order."""
        return [name.strip() for name in self.labels.split(",")]

    def embedding_forward_s(self, tokens: int) -> float:
        """Seconds of one embedding forward over `tokens` prompt tokens (speed applied): a
        fixed step plus the tokens at --embedding-tps; prefill only, nothing is decoded."""
        if self.instant:
            return 0.0
        return (self.embedding_step_ms / 1000.0 + tokens / self.embedding_tps) / self.speed

    @property
    def queued_cap(self) -> int | None:
        """Requests that may wait beyond the running ones (None: no limit). A server that
        refuses when full (--overload) keeps no queue unless --max-queued-requests says."""
        if self.max_queued_requests is not None:
            return self.max_queued_requests
        return None if self.overload == "queue" else 0

    @property
    def windows(self) -> tuple[Window, ...]:
        """The --error-window values, parsed."""
        return tuple(Window.parse(w) for w in self.error_window)

    @property
    def hybrid(self) -> bool:
        """Whether the Mamba-hybrid capacity model applies."""
        return self.model_arch == "mamba-hybrid"

    @classmethod
    def from_argv(cls, argv: list[str], environ: dict[str, str] | None = None) -> SimConfig:
        """Parse SGLang-style flags; bad flags exit 2 with argparse usage, like SGLang."""
        parser = build_parser()
        ns = parser.parse_args(argv)
        values = {f.name: getattr(ns, f.name) for f in dataclasses.fields(cls)}
        values["fail_prompt"] = tuple(ns.fail_prompt or ())
        values["error_window"] = tuple(ns.error_window or ())
        values["poison"] = tuple(ns.poison or ())
        if ns.max_num_seqs is not None:
            if values["flavor"] != "vllm":  # SGLang has no such flag: it exits 2 on it
                parser.error("unrecognized arguments: --max-num-seqs (only with --flavor vllm)")
            values["max_running_requests"] = ns.max_num_seqs
        if ns.runner is not None:
            if values["flavor"] != "vllm":  # vLLM's flag; SGLang exits 2 on it
                parser.error("unrecognized arguments: --runner (only with --flavor vllm)")
            values["is_embedding"] = ns.runner == "pooling"
        elif values["is_embedding"] and values["flavor"] == "vllm":
            parser.error("unrecognized arguments: --is-embedding (--flavor vllm: "
                         "--runner pooling)")
        env = os.environ if environ is None else environ
        if not values["force_shutdown"]:
            values["force_shutdown"] = env.get("SGL_FORCE_SHUTDOWN", "").lower() in ("1", "true")
        if values["speculative_algorithm"]:
            values["speculative_algorithm"] = values["speculative_algorithm"].upper()
        try:
            return cls(**values)
        except ConfigError as exc:
            parser.error(str(exc))
            raise  # parser.error exits; this keeps mypy's flow analysis honest


def build_parser() -> argparse.ArgumentParser:
    """The argparse parser of every SimConfig field (flag = field name with dashes)."""
    parser = argparse.ArgumentParser(
        prog=PROG, description="fleetgen's SGLang simulator (python -m launcher sim).",
        allow_abbrev=True)
    for f in dataclasses.fields(SimConfig):
        flags = f.metadata["flags"] or ("--" + f.name.replace("_", "-"),)
        kw = dict(f.metadata["kw"])
        kw.setdefault("default", [] if kw.get("action") == "append" else f.default)
        parser.add_argument(*flags, dest=f.name, help=f.metadata["help"], **kw)
    parser.add_argument("--disable-metrics", dest="enable_metrics", action="store_false",
                        help="no /metrics endpoint (404), as SGLang without --enable-metrics")
    parser.add_argument("--max-num-seqs", type=int, default=None,
                        help="vLLM's name of --max-running-requests (--flavor vllm only)")
    parser.add_argument("--runner", choices=("auto", "generate", "pooling"), default=None,
                        help="vLLM's model runner: pooling serves an embedding model, as "
                        "--is-embedding does for SGLang (--flavor vllm only)")
    return parser
