"""The bodies of /server_info, /model_info and /v1/models (docs/reference/sglang.md §4.2-4.4).

With --flavor vllm or strict, /v1/models lists vLLM 0.11.0's ModelCard or transformers serve's
pinned-model entry instead (docs/development/simulator.md#other-engines).
"""

from __future__ import annotations

import hashlib
import os
import time
from typing import Any, NotRequired, TypedDict

from launcher.sim.capacity import AVAIL_BEFORE_LOAD_GB
from launcher.sim.simulator import Simulator

MODEL_CLASSES = {"dense": ("Qwen3ForCausalLM", "qwen3"),
                 "mamba-hybrid": ("Qwen3_5ForConditionalGeneration", "qwen3_5")}
DRAFT_CLASS = "Qwen3_5ForCausalLMMTP"


def server_args(sim: Simulator) -> dict[str, Any]:
    """The resolved launch arguments (what SGLang logs as `server_args=` and echoes)."""
    cfg, cap = sim.cfg, sim.capacity
    return {
        "model_path": cfg.model_path, "tokenizer_path": cfg.tokenizer_path or cfg.model_path,
        "load_format": cfg.load_format, "trust_remote_code": cfg.trust_remote_code,
        "context_length": cfg.context_length, "kv_cache_dtype": cfg.kv_cache_dtype,
        "served_model_name": cfg.served_name, "is_embedding": cfg.is_embedding,
        "host": cfg.host, "port": sim.port,
        "nccl_port": cfg.nccl_port, "tp_size": cfg.tp_size, "dp_size": cfg.dp_size,
        "pp_size": cfg.pp_size, "enable_dp_attention": cfg.enable_dp_attention,
        "base_gpu_id": cfg.base_gpu_id, "mem_fraction_static": cap.mem_fraction_static,
        "max_running_requests": cap.requested_running,
        "max_queued_requests": cfg.max_queued_requests, "max_total_tokens": cfg.max_total_tokens,
        "chunked_prefill_size": cfg.chunked_prefill_size,
        "max_prefill_tokens": cfg.max_prefill_tokens, "page_size": 1,
        "disable_radix_cache": cfg.disable_radix_cache,
        "mamba_radix_cache_strategy": cap.mamba_strategy or cfg.mamba_radix_cache_strategy,
        "max_mamba_cache_size": cfg.max_mamba_cache_size,
        "mamba_full_memory_ratio": cfg.mamba_full_memory_ratio,
        "mamba_ssm_dtype": cfg.mamba_ssm_dtype,
        "cuda_graph_max_bs_decode": cap.cuda_graph_max_bs,
        "speculative_algorithm": cfg.speculative_algorithm,
        "speculative_draft_model_path": cfg.speculative_draft_model_path or (
            cfg.model_path if cfg.speculative else None),
        "speculative_num_steps": cap.spec_steps, "speculative_eagle_topk": cap.spec_topk,
        "speculative_num_draft_tokens": cap.spec_draft_tokens,
        "reasoning_parser": cfg.reasoning_parser, "tool_call_parser": cfg.tool_call_parser,
        "enable_metrics": cfg.enable_metrics, "decode_log_interval": cfg.decode_log_interval,
        "log_level": cfg.log_level, "log_level_http": cfg.log_level_http,
        "api_key": cfg.api_key, "watchdog_timeout": cfg.watchdog_timeout,
        "skip_server_warmup": cfg.skip_server_warmup,
        "allow_auto_truncate": cfg.allow_auto_truncate,
        "enable_cache_report": cfg.enable_cache_report,
        "default_chat_template_kwargs": cfg.default_chat_template_kwargs,
        "random_seed": cfg.seed,
    }


def max_req_input_len(sim: Simulator) -> int:
    """The longest accepted prompt, as the scheduler reports it."""
    return min(sim.cfg.context_len - 1, sim.capacity.max_total_num_tokens - 1) - 5


def _internal_state(sim: Simulator) -> dict[str, Any]:
    """One DP rank's `internal_states` element: its scheduler's view, with the rank's
    effective running cap (every rank of the simulator has the same pools)."""
    cap = sim.capacity
    state: dict[str, Any] = {
        **server_args(sim), "world_size": sim.cfg.rank_gpus, "startup_time": sim.startup_seconds,
        "effective_max_running_requests_per_dp": cap.effective_running,
        "last_gen_throughput": sim.scheduler.last_gen_throughput / sim.cfg.dp_size,
        "memory_usage": {"weight": round(cap.weights_gb, 2), "kvcache": round(cap.kv_gb, 2),
                         "startup_available": AVAIL_BEFORE_LOAD_GB,
                         "token_capacity": cap.max_total_num_tokens, "token_capacity_swa": None,
                         "graph": {"decode": cap.graph_gb}},
    }
    if cap.mamba_cache_size is not None:
        state["max_mamba_cache_size"] = cap.mamba_cache_size
    if sim.cfg.speculative:
        state["avg_spec_accept_length"] = sim.cfg.speculative_accept_length
    return state


def server_info(sim: Simulator) -> dict[str, Any]:
    """The flat /server_info dict."""
    return {
        **server_args(sim), "launch_command": sim.launch_command,
        "max_total_num_tokens": sim.capacity.max_total_num_tokens,
        "max_req_input_len": max_req_input_len(sim), "status": "ready",
        "startup_time": sim.startup_seconds, "hicache_object_layout": None, "kv_events": None,
        "internal_states": [_internal_state(sim) for _ in range(sim.cfg.dp_size)],
        "version": sim.cfg.sglang_version,
        "frontend": "python",
    }


class ModelInfo(TypedDict):
    """The /model_info body."""

    model_path: str
    served_model_name: str
    tokenizer_path: str
    is_generation: bool
    preferred_sampling_params: None
    weight_version: str
    load_format: str
    reasoning_parser: str | None
    tool_call_parser: str | None
    disaggregation_mode: str
    has_image_understanding: bool
    has_audio_understanding: bool
    model_type: str
    architectures: list[str]


class ModelPermission(TypedDict):
    """vLLM's ModelPermission, as its ModelCard lists one."""

    id: str
    object: str
    created: int
    allow_create_engine: bool
    allow_sampling: bool
    allow_logprobs: bool
    allow_search_indices: bool
    allow_view: bool
    allow_fine_tuning: bool
    organization: str
    group: None
    is_blocking: bool


class ModelCard(TypedDict):
    """One /v1/models entry: SGLang's and vLLM's (which adds `permission`) share the rest;
    transformers serve's has `id`, `object`, `created`, `owned_by` and `status` only."""

    id: str
    object: str
    created: int
    owned_by: str
    root: NotRequired[str]
    parent: NotRequired[None]
    max_model_len: NotRequired[int]
    permission: NotRequired[list[ModelPermission]]
    status: NotRequired[dict[str, str]]


def model_info(sim: Simulator) -> ModelInfo:
    """The /model_info dict."""
    cfg = sim.cfg
    model_class, model_type = MODEL_CLASSES[cfg.model_arch]
    return {"model_path": cfg.model_path, "served_model_name": cfg.served_name,
            "tokenizer_path": cfg.tokenizer_path or cfg.model_path, "is_generation": not cfg.is_embedding,
            "preferred_sampling_params": None, "weight_version": "default",
            "load_format": cfg.load_format, "reasoning_parser": cfg.reasoning_parser,
            "tool_call_parser": cfg.tool_call_parser, "disaggregation_mode": "null",
            "has_image_understanding": False, "has_audio_understanding": False,
            "model_type": model_type, "architectures": [model_class]}


def model_card(sim: Simulator) -> ModelCard:
    """One /v1/models entry, in the flavour's shape."""
    if sim.cfg.flavor == "vllm":
        return _vllm_model_card(sim)
    if sim.cfg.flavor == "strict":
        return _strict_model_card(sim)
    name = sim.cfg.served_name
    return {"id": name, "object": "model", "created": int(time.time()), "owned_by": "sglang",
            "root": name, "parent": None, "max_model_len": sim.cfg.context_len}


def _vllm_model_card(sim: Simulator) -> ModelCard:
    """vLLM 0.11.0's ModelCard: `root` is the model path, one default ModelPermission."""
    cfg, now = sim.cfg, int(time.time())
    perm_id = hashlib.blake2b(cfg.served_name.encode(), digest_size=16).hexdigest()
    permission: ModelPermission = {"id": f"modelperm-{perm_id}", "object": "model_permission", "created": now,
                  "allow_create_engine": False, "allow_sampling": True, "allow_logprobs": True,
                  "allow_search_indices": False, "allow_view": True, "allow_fine_tuning": False,
                  "organization": "*", "group": None, "is_blocking": False}
    return {"id": cfg.served_name, "object": "model", "created": now, "owned_by": "vllm",
            "root": cfg.model_path, "parent": None, "max_model_len": cfg.context_len,
            "permission": [permission]}


def _strict_model_card(sim: Simulator) -> ModelCard:
    """transformers serve's entry for the model it is pinned to (`model_owner`: the Hub
    organization, "local" for a path, "" for a bare name)."""
    name = sim.cfg.served_name
    repo = name.split("@", 1)[0]
    owner = "local" if os.path.exists(repo) else repo.split("/")[0] if "/" in repo else ""
    return {"owned_by": owner, "id": name, "object": "model", "created": 0,
            "status": {"value": "loaded"}}
