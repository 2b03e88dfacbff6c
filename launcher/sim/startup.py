"""SGLang's start-up log sequence, and its start-up failures.

As in docs/reference/sglang.md#startup, docs/reference/sglang.md#startup-lines and
docs/reference/sglang.md#fatal-lines.

Order: server_args, (spec warning), Load weight begin/end, pool warnings, Mamba Cache (hybrid),
KV Cache, Memory pool end, CUDA graph capture, the summary line with the effective
max_running_requests, then template lines. uvicorn's lines, the warmup Prefill batch and
"The server is fired up and ready to roll!" follow once the port is open (server.py).
"""

from __future__ import annotations

import logging
import time

from launcher.sim import info, logs
from launcher.sim.capacity import AVAIL_BEFORE_LOAD_GB, DRAFT_WEIGHTS_GB, SPEC_RESET_WARNING
from launcher.sim.simulator import Simulator

log = logging.getLogger("launcher.sim.server")
sched_log = logging.getLogger(logs.SCHEDULER_LOGGER)
SAMPLING_DEFAULTS = "{'repetition_penalty': 1.0, 'temperature': 0.6, 'top_k': 20, 'top_p': 0.95}"


def startup_oom_error(sim: Simulator) -> str:
    """SGLang's start-up OOM (pool_configurator.py)."""
    return ("RuntimeError: Not enough memory. Please try to increase --mem-fraction-static. "
            f"Current value: mem_fraction_static={sim.capacity.mem_fraction_static}")


def announce(sim: Simulator) -> bool:
    """Log the loading sequence (sleeping --load-delay); False if start-up died."""
    cfg, cap = sim.cfg, sim.capacity
    log.info("server_args=%s", info.server_args(sim))
    if cfg.speculative and cfg.max_running_requests is None:
        log.warning(SPEC_RESET_WARNING)
    sched_log.info("Load weight begin. avail mem=%.2f GB", AVAIL_BEFORE_LOAD_GB)
    if cfg.load_delay:
        time.sleep(cfg.load_delay)
    model_class = info.MODEL_CLASSES[cfg.model_arch][0]
    base = AVAIL_BEFORE_LOAD_GB - (cap.weights_gb - DRAFT_WEIGHTS_GB if cfg.speculative
                                   else cap.weights_gb)
    sched_log.info(logs.load_weight_end(cfg.log_format, model_class, base,
                                        AVAIL_BEFORE_LOAD_GB - base))
    if cfg.speculative:
        sched_log.info(logs.load_weight_end(cfg.log_format, info.DRAFT_CLASS,
                                            cap.avail_after_weights_gb, DRAFT_WEIGHTS_GB))
    fatal = startup_oom_error(sim) if cfg.startup_oom else cap.fatal
    if fatal is not None:
        sim.startup_fatal(fatal)
        return False
    for warning in cap.warnings:
        sched_log.warning(warning)
    _log_pools(sim)
    return True


def _log_pools(sim: Simulator) -> None:
    cfg, cap = sim.cfg, sim.capacity
    if cap.mamba_cache_size is not None:
        spec_gb = cap.spec_state_gb if cfg.speculative else None
        plain = cap.mamba_gb - (spec_gb or 0.0)
        sched_log.info(logs.mamba_line(cap.mamba_cache_size, plain * 0.04, plain * 0.96, spec_gb))
    sched_log.info(logs.kv_line(cfg.log_format, cap.max_total_num_tokens, cap.kv_gb))
    avail = cap.avail_after_pools_gb
    sched_log.info("Memory pool end. avail mem=%.2f GB", avail)
    draft = cap.spec_draft_tokens
    if draft:
        for line in logs.cuda_graph_lines(cfg.log_format, "draft", 1, cap.capture_bs, avail,
                                          cap.graph_gb / 3):
            sched_log.info(line)
        avail -= cap.graph_gb / 3
    for line in logs.cuda_graph_lines(cfg.log_format, "target", draft or 1, cap.capture_bs,
                                      avail, cap.graph_gb):
        sched_log.info(line)
    sched_log.info(logs.summary_line(cap.max_total_num_tokens, cfg.chunked_prefill_size,
                                     cfg.max_prefill_tokens, cap.effective_running,
                                     cfg.context_len, avail - cap.graph_gb))
    log.info("Auto-detected template features: reasoning_config=None, reasoning_parser=%s, "
             "tool_call_parser=%s", cfg.reasoning_parser, cfg.tool_call_parser)
    log.info("Using default chat sampling params from model generation config: %s",
             SAMPLING_DEFAULTS)
