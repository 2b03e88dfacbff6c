"""What to do about each kind of fatal error an SGLang log can show, keyed by `FatalKind`."""

from __future__ import annotations

from launcher.logparse import FatalKind

HINTS: dict[FatalKind, str] = {
    "kv_no_memory": "no room for the KV cache: raise --mem-fraction-static, or use more GPUs (tp)",
    "weights_no_memory": "the weights fill the GPU: raise --mem-fraction-static to the minimum "
    "the message names, quantize, or use more GPUs (tp)",
    "zero_requests": "no request fits: raise --mem-fraction-static or lower --context-length",
    "pool_too_small": "the KV pool is smaller than one request: raise --mem-fraction-static "
    "or lower --context-length",
    "mamba_no_memory": "no room for the Mamba state: lower --max-running-requests or "
    "--speculative-num-draft-tokens, or raise --mem-fraction-static",
    "mamba_too_small": "the Mamba state pool cannot hold one request: raise "
    "--max-mamba-cache-size or --mem-fraction-static",
    "cuda_graph": "graph capture ran out of memory: lower --mem-fraction-static (e.g. 0.8) or "
    "--cuda-graph-max-bs-decode (e.g. 16)",
    "cuda_oom": "CUDA OOM: lower --mem-fraction-static, --max-running-requests or "
    "--chunked-prefill-size",
    "watchdog": "a batch made no progress for --watchdog-timeout seconds: the GPU or NCCL hung; "
    "restart the server",
    "scheduler_exception": "the scheduler crashed: read the traceback that follows this line",
    "scheduler_died": "a scheduler died while starting; exit code -9 is usually the OS OOM "
    "killer (dmesg -T | grep -i oom)",
    "warmup_failed": "the warmup request failed: read the traceback that follows this line",
    "init_failed": "a scheduler failed to start: read the errors above this line",
    "health_check": "the detokenizer stopped answering: the server is hung; restart it",
    "port_in_use": "the HTTP port is taken: pick a free --port",
    "sigquit": "a child process failed: look for its traceback above this line",
}
