"""The one place that reads the environment.

Every process (worker, producer, Flower) builds one `Settings` with `Settings.from_env()`;
tests build `Settings(...)` directly. Precedence is flag > environment > default: CLIs pass
their flags through `dataclasses.replace`.
"""

from __future__ import annotations

import os
import re
import typing
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any
from urllib.parse import quote, urlsplit, urlunsplit

from pydantic import TypeAdapter, ValidationError
from tenacity import Retrying, retry_if_exception_type, stop_after_delay

from fleetgen.errors import FleetgenError
from fleetgen.redact import redact
from fleetgen.redisconn import endpoints
from fleetgen.retry import backoff

# The embedded Valkey of `python -m launcher redis` listens here by default, keeps the password
# it generates in this file (relative to where it was started) and, while it runs, the port it
# serves in the file beside it; a bare `python -m producer` or `celery -A workers worker` run
# there finds both without configuration, and so does one whose REDIS_URL names that port on
# loopback without a password (the README's `--port` advice).
EMBEDDED_REDIS_URL = "redis://127.0.0.1:6389/0"
EMBEDDED_REDIS_PASSWORD_FILE = Path(".fleetgen/redis/password")
EMBEDDED_REDIS_PORT_FILE = EMBEDDED_REDIS_PASSWORD_FILE.with_name("port")
# The names a REDIS_URL gives this machine by: only there can the embedded Valkey be.
LOOPBACK_HOSTS = ("127.0.0.1", "localhost", "::1")
# The clone (an editable install's source tree). The repository's `.env` names the password
# file relatively; loaded in another directory (`cd ~ && celery -A workers flower`), that name
# is resolved here when the working directory has no such file (locate_secret_file).
PROJECT_DIR = Path(__file__).resolve().parent.parent
# The Sentinels' name for the master when REDIS_URL is `sentinel://...` (fleetgen/redisconn.py).
REDIS_MASTER_NAME = "mymaster"
# SGLang's default port, which the launcher gives GPU 0's server whatever its kind; GPU i's
# server listens on SERVER_BASE_PORT + i.
SERVER_BASE_PORT = 30000
# A finished job's Redis keys last a week: time to look at it and export it after a weekend,
# while a fleet running thousands of jobs keeps a bounded Redis. The sink keeps everything.
JOB_RETENTION_S = 7 * 86400.0
# FLEETGEN_REDIS_PASSWORD_FILE may name a file that is not there yet: the Procfile starts the
# embedded Redis, which writes it at its first start, together with the processes that read it.
PASSWORD_FILE_WAIT_S = 15.0


class SettingsError(FleetgenError, ValueError):
    """An environment variable holds a value fleetgen cannot use."""


@dataclass(frozen=True)
class Settings:
    redis_url: str = EMBEDDED_REDIS_URL
    redis_master_name: str = REDIS_MASTER_NAME
    # More Redis servers for the jobs' ledger keys (comma-separated URLs; REDIS_URL's server is
    # the first shard and stays the broker's and the registry's): a fleet whose per-prompt
    # ledger work outgrows one Redis adds one (fleetgen/ledger/_shards.py). Unset: one Redis.
    ledger_urls: tuple[str, ...] = ()
    # Explicit server for this worker; unset means "derive from the GPU queue" (gpuN → base+N).
    # Any kind of server (SGLang, vLLM, `transformers serve`, ...).
    server_url: str | None = None
    server_base_port: int = SERVER_BASE_PORT
    server_api_key: str | None = None
    # Hours, not minutes: a thinking model may decode 30k tokens at 20 tok/s under load.
    request_timeout_s: float = 4 * 3600.0
    connect_timeout_s: float = 10.0
    # Requests kept waiting in the server's own queue above its effective max_running_requests,
    # so a finishing request is replaced without a client round trip.
    queue_margin: int = 4
    queue_margin_ratio: float = 0.1
    # How often the worker re-reads /server_info: a restarted server may have another capacity.
    capacity_refresh_s: float = 30.0
    # Requests kept in flight to a server that does not say what it runs (no /server_info nor
    # /get_server_info: vLLM, llama.cpp, a gateway); unset, the worker keeps 1 and warns.
    max_in_flight: int | None = None
    # One prompt's transient failures (5xx, timeouts, resets) are retried this many times.
    prompt_max_attempts: int = 4
    retry_backoff_s: float = 2.0
    retry_backoff_max_s: float = 60.0
    # A batch whose server stays down this long goes back to the queue (no attempt spent).
    server_down_wait_s: float = 300.0
    # The least time requests may be in flight with nothing back before a probe asks whether
    # the server hangs (the usual gap between replies sets more: workers/flow.py `Progress`);
    # half a minute is far beyond a working server's gap at any useful load, and a hung GPU
    # then costs a minute, not the request timeout.
    hang_after_s: float = 30.0
    # A warm shutdown (SIGTERM) sends nothing more and waits this long for the requests at the
    # server, then hands them back unanswered (no attempt), whatever the server does.
    shutdown_grace_s: float = 30.0
    # A rollout's own time (its code, tools and verifiers: the time outside its calls to the
    # server) is limited to this; past it the prompt fails with `rollout_timeout`.
    rollout_time_limit_s: float = 600.0
    # Threads that run rollouts' CPU work (`generate.run`: tools, verifiers) in each worker.
    rollout_threads: int = 32
    # Lease per running batch: a dead worker's batch is re-dispatched within about
    # lease_ttl + reconcile_interval (~45 s), well inside the 60 s promise.
    lease_ttl_s: float = 30.0
    lease_renew_s: float = 5.0
    reconcile_interval_s: float = 10.0
    # A lost broker message is only suspected after this long in "queued" with no consumer.
    lost_message_grace_s: float = 120.0
    # Worker deaths a batch may cause before it is failed (a poison batch must not loop).
    batch_max_attempts: int = 5
    # The failure breaker (fleetgen/breaker.py) pauses a job whose newest `streak` outcomes are
    # failures with one cause, or one of whose causes makes `share` of its last `window`
    # outcomes. A prompt's own 4xx (too long, bad input) comes alone: 20 in a row is a server
    # refusing them all, found after 20 prompts instead of a whole dataset. 0 turns it off.
    breaker_streak: int = 20
    breaker_window: int = 50
    breaker_share: float = 0.9
    # Sink writes retried through an S3 outage for this long before the batch is given up.
    sink_retry_deadline_s: float = 600.0
    # A job whose output this worker cannot write is left to other workers this long, then
    # checked again (a fixed credential or bucket policy brings the worker back).
    sink_recheck_s: float = 60.0
    s3_addressing_style: str = "path"
    # Broker-level safety net only: leases do the real work (docs/development/delivery.md#leases).
    visibility_timeout_s: int = 7200
    # Finished prompts are checkpointed in one Redis call per group, which closes at 64
    # records (checkpoints.GROUP_RECORDS) or this long after its oldest; 0: a call as soon as
    # the previous is back. At 25 answers a second per GPU a group then carries ~50, which
    # brings Redis's CPU per answer near a record's own cost, and one Redis carries a thousand
    # such GPUs in half a core, batches, leases and the registry included
    # (tests/perf/checkpoint_cost.py, tests/perf/redis_capacity.py). An answer waits for its
    # group about half the window (the whole window at most) in the worker's memory; it is the
    # most finished work a crash loses (asked again, never written twice) and what the window
    # adds to a batch's end, next to seconds of generation. An override, not a knob a fleet
    # needs: docs/getting-started/several-nodes.md#how-many-gpus-one-redis-carries.
    checkpoint_window_s: float = 2.0
    # Most batches one worker holds (its pool threads); it takes the next only when its unsent
    # prompts run low, so this is a ceiling, not a target. It must exceed the server's
    # max_running_requests: near a job's end every batch may be waiting on one long answer,
    # and a worker at the ceiling leaves slots idle while batches wait in the queue.
    batch_concurrency: int = 128
    # How long a finished (done or cancelled) job's Redis keys are kept, in seconds; the env
    # takes a duration too (`7d`, `12h`).
    job_retention: float = JOB_RETENTION_S
    # Per-process /metrics: None means keys.METRICS_BASE_PORT+N for queue gpuN; 0 turns it off.
    metrics_port: int | None = None
    metrics_host: str = "127.0.0.1"
    # The server URL this worker publishes for other nodes (fleetgen/advertise.py): the whole
    # URL, or the host put in place of a loopback one; unset means the address on the route
    # to Redis.
    advertise_url: str | None = None
    advertise_host: str | None = None
    # Where the producer's commands write and look for jobs given no --output (its
    # DEFAULT_OUTPUT when unset; the demo's own default is its S3).
    output: str | None = None
    extra: Mapping[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not self.redis_url.startswith(("redis://", "rediss://", "redis+socket://", "unix://",
                                          "sentinel://")):
            raise SettingsError("REDIS_URL must be a redis:// or sentinel:// URL, got "
                                f"{redact(self.redis_url)!r}")
        for name, url in (("FLEETGEN_SERVER_URL", self.server_url),
                          ("FLEETGEN_ADVERTISE_URL", self.advertise_url)):
            parts = urlsplit(url or "")
            # The URL is logged, published in the worker registry and written into every result
            # line: a credential in it would travel everywhere the key must not.
            if parts.username or parts.password or parts.query:
                raise SettingsError(
                    f"{name} must not carry credentials or a query ({redact(url or '')}):"
                    " give the server's key in FLEETGEN_SERVER_API_KEY")
        for f in fields(self):
            value = getattr(self, f.name)
            if isinstance(value, (int, float)) and not isinstance(value, bool) and value < 0:
                raise SettingsError(f"FLEETGEN_{f.name.upper()} must be >= 0, got {value}")
        if not 0 < self.breaker_share <= 1:
            raise SettingsError(f"FLEETGEN_BREAKER_SHARE must be above 0 and at most 1, got "
                                f"{self.breaker_share}")
        if self.breaker_streak and self.breaker_window < 1:
            raise SettingsError("FLEETGEN_BREAKER_WINDOW must be >= 1 while the breaker is on "
                                "(FLEETGEN_BREAKER_STREAK > 0)")
        if self.job_retention < 1:
            raise SettingsError(f"FLEETGEN_JOB_RETENTION must be at least 1 second, got "
                                f"{self.job_retention:g}")
        if self.hang_after_s < 1:
            raise SettingsError(f"FLEETGEN_HANG_AFTER_S must be at least 1 second, got "
                                f"{self.hang_after_s:g}")
        if self.rollout_threads < 1:
            raise SettingsError(f"FLEETGEN_ROLLOUT_THREADS must be at least 1, got "
                                f"{self.rollout_threads}")
        if self.lease_renew_s * 2 >= self.lease_ttl_s:
            raise SettingsError("FLEETGEN_LEASE_RENEW_S must be under half of FLEETGEN_LEASE_TTL_S")
        named: dict[str, str] = {}
        for url in self.ledger_urls:
            if not url.startswith(_LEDGER_SCHEMES):
                raise SettingsError("FLEETGEN_LEDGER_URLS takes redis://, rediss:// or unix:// "
                                    f"URLs, one server each, got {redact(url)!r}")
            name = ledger_shard_name(url)
            if name in named:
                raise SettingsError(f"FLEETGEN_LEDGER_URLS names the server {name} twice "
                                    f"({redact(named[name])!r}, {redact(url)!r})")
            named[name] = url

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> Settings:
        """Build settings from `REDIS_URL`, `FLEETGEN_*` variables and the OLDER_NAMES."""
        env = os.environ if env is None else env
        kwargs: dict[str, object] = {}
        hints = typing.get_type_hints(cls)
        if env.get("REDIS_URL"):
            kwargs["redis_url"] = env["REDIS_URL"]
        for f in fields(cls):
            name = _named(env, f.name)
            if name is None or f.name in ("extra",):
                continue
            if f.name in _LISTS:
                kwargs[f.name] = tuple(u.strip() for u in env[name].split(",") if u.strip())
                continue
            kwargs[f.name] = (parse_duration(name, env[name]) if f.name in _DURATIONS
                              else _coerce(name, env[name], hints[f.name]))
        if isinstance(kwargs.get("server_url"), str):
            kwargs["server_url"] = str(kwargs["server_url"]).rstrip("/")
        if env.get("FLEETGEN_REDIS_PASSWORD_FILE"):
            kwargs["redis_url"] = with_password(
                str(kwargs.get("redis_url", EMBEDDED_REDIS_URL)),
                read_secret_file(locate_secret_file(Path(env["FLEETGEN_REDIS_PASSWORD_FILE"])),
                                 PASSWORD_FILE_WAIT_S))
        elif (embedded := embedded_redis_url(
                str(kwargs["redis_url"]) if "redis_url" in kwargs else None)) is not None:
            kwargs["redis_url"] = embedded
        return cls(**kwargs)  # type: ignore[arg-type]

    def server_url_for_gpu(self, index: int) -> str:
        return f"http://127.0.0.1:{self.server_base_port + index}"

    def __repr__(self) -> str:
        # Settings end up in tracebacks and debug logs: never with the Redis password or a key.
        shown = ", ".join(f"{f.name}={_shown(f.name, getattr(self, f.name))!r}"
                          for f in fields(self) if f.name != "extra")
        return f"Settings({shown})"


# The names a setting was read by before the server settings served every kind of server
# (they were SGLang's): read when the setting's own FLEETGEN_* name is not set, the first one
# set winning (an empty short name counts as unset).
OLDER_NAMES: dict[str, tuple[str, ...]] = {
    "server_url": ("FLEETGEN_SGLANG_URL", "SGLANG_URL"),
    "server_api_key": ("FLEETGEN_SGLANG_API_KEY", "SGLANG_API_KEY"),
    "server_base_port": ("FLEETGEN_SGLANG_BASE_PORT",),
}


def setting(field_name: str, env: Mapping[str, str] | None = None) -> str | None:
    """One setting's value as the environment gives it, read as `from_env` reads it, without
    building Settings: for a command that needs this one value and must not fail on another
    (the launcher's `advise` and `tune` read `server_api_key` so)."""
    env = os.environ if env is None else env
    name = _named(env, field_name)
    return None if name is None else env[name]


def _named(env: Mapping[str, str], field_name: str) -> str | None:
    """The variable the setting `field_name` is read from: FLEETGEN_<NAME>, else its first
    older name that is set; None when none is."""
    name = f"FLEETGEN_{field_name.upper()}"
    if name in env:
        return name
    return next((old for old in OLDER_NAMES.get(field_name, ())
                 if env.get(old) or (old.startswith("FLEETGEN_") and old in env)), None)


def _shown(name: str, value: object) -> object:
    if isinstance(value, tuple):
        return tuple(_shown(name, v) for v in value)
    return redact(value, name=name) if isinstance(value, str) else value


def ledger_shard_name(url: str) -> str:
    """The address a ledger shard URL names, `host:port/db` (a socket's path), never its
    credentials: how this process calls the server in its messages, what catches a URL listed
    twice, and the first part of the name a new shard is given (fleetgen/ledger/_shards.py:
    a shard's name is its server's own, whatever address a process reaches it at)."""
    parts = urlsplit(url)
    if parts.scheme in ("unix", "redis+socket"):
        return parts.path
    db = parts.path.strip("/") or "0"
    return f"{parts.hostname or '127.0.0.1'}:{parts.port or 6379}/{db}"


def with_password(url: str, password: str) -> str:
    """`url` with `password` in its userinfo, unless the URL already carries one."""
    if ";" in url:  # Sentinels: the first part's password is the master's (redisconn.py)
        first, rest = url.split(";", 1)
        return f"{with_password(first, password)};{rest}"
    parts = urlsplit(url)
    if parts.password or not password or parts.scheme not in ("redis", "rediss", "sentinel"):
        return url
    user = quote(parts.username or "", safe="")
    netloc = f"{user}:{quote(password, safe='')}@{parts.hostname or ''}"
    if parts.port:
        netloc += f":{parts.port}"
    return urlunsplit(parts._replace(netloc=netloc))


def embedded_redis_url(url: str | None) -> str | None:
    """The URL to reach the embedded Valkey with its password, for a command given no password
    file: `url` (REDIS_URL) with the password when it names the port the embedded Valkey serves
    on loopback and carries no credentials, the embedded Valkey's own address when `url` is
    None; None when there is no embedded Valkey next to this command or `url` names another
    server (which must never be sent its password)."""
    password_file = locate_secret_file(EMBEDDED_REDIS_PASSWORD_FILE)
    if not password_file.is_file():
        return None
    served = _served_port(password_file.with_name(EMBEDDED_REDIS_PORT_FILE.name))
    if url is None:
        url = EMBEDDED_REDIS_URL if served is None else f"redis://127.0.0.1:{served}/0"
    elif served is None or _port(url) != served:
        return None
    else:
        parts = urlsplit(url)
        if (parts.scheme != "redis" or parts.hostname not in LOOPBACK_HOSTS or parts.username
                or parts.password):
            return None
    return with_password(url, read_secret_file(password_file))


def _port(url: str) -> int | None:
    try:
        return endpoints(url)[0][1]
    except ValueError:  # no port number: not the embedded Valkey's URL
        return None


def _served_port(path: Path) -> int | None:
    try:
        return int(path.read_text())
    except (OSError, ValueError):
        return None


def locate_secret_file(path: Path) -> Path:
    """Where a secret file named by a relative path lives: in the working directory if it is
    there, else in the clone whose `.env` names it (PROJECT_DIR) if it is there, else the
    working directory's (absolute, so an error names the file looked for)."""
    if path.is_absolute() or path.exists():
        return path.absolute()
    in_project = PROJECT_DIR / path
    if (PROJECT_DIR / ".env").is_file() and in_project.exists():
        return in_project
    return path.absolute()


def read_secret_file(path: Path, wait_s: float = 0.0) -> str:
    """The secret held in `path` (surrounding whitespace dropped), waiting up to `wait_s` for
    the file to appear; SettingsError naming the file (never its content) if it cannot be read.
    """
    try:
        secret = Retrying(retry=retry_if_exception_type(FileNotFoundError),
                          stop=stop_after_delay(wait_s), wait=backoff(0.1, 0.1),
                          reraise=True)(lambda: path.read_text().strip())
    except FileNotFoundError:
        raise SettingsError(f"{path}: no such secret file (the embedded Redis writes it at its "
                            "first start: `python -m launcher redis`)") from None
    except OSError as exc:
        raise SettingsError(f"{path}: {exc.strerror or exc}") from None
    if not secret:
        raise SettingsError(f"{path}: the secret file is empty")
    return secret


# Settings the environment gives as comma-separated lists.
_LISTS = ("ledger_urls",)
# A ledger shard is one server: a Sentinel URL names a master by FLEETGEN_REDIS_MASTER_NAME,
# which REDIS_URL's master already holds.
_LEDGER_SCHEMES = ("redis://", "rediss://", "unix://", "redis+socket://")
# Settings the environment may give as a duration (`7d`) besides seconds.
_DURATIONS = ("job_retention",)
_UNITS = {"": 1.0, "s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0, "w": 7 * 86400.0}
_DURATION = re.compile(r"^\s*(\d+(?:\.\d*)?|\.\d+)\s*([smhdw]?)\s*$")


def parse_duration(name: str, raw: str) -> float:
    """Seconds in `raw`: a number of seconds, or one with a unit s, m, h, d or w (`7d`)."""
    match = _DURATION.match(raw.lower())
    if match is None:
        raise SettingsError(f"{name}={raw!r} is not a duration: seconds, or a number with "
                            "s, m, h, d or w (e.g. 7d)")
    return float(match[1]) * _UNITS[match[2]]


def _coerce(name: str, raw: str, hint: Any) -> object:
    """`raw` as the field's declared type (pydantic's string rules: `3` for an int, `0.5` for
    a float); one SettingsError line naming the variable otherwise."""
    try:
        return TypeAdapter(hint).validate_strings(raw.strip())
    except ValidationError as exc:
        why = exc.errors()[0]["msg"].replace("Input should be", "should be")
        raise SettingsError(f"{name}={raw!r}: {why}") from None


ENV_DOC: dict[str, str] = {
    "REDIS_URL": f"broker + ledger (default {EMBEDDED_REDIS_URL}, the embedded Valkey)",
    "FLEETGEN_SERVER_URL / SGLANG_URL": "this worker's server (any kind; SGLANG_URL is the "
                                        "older name); default http://127.0.0.1:(30000+N) for "
                                        "queue gpuN",
    "FLEETGEN_SERVER_API_KEY / SGLANG_API_KEY": "Bearer key if the servers run with --api-key "
                                                "(SGLANG_API_KEY is the older name); sent to "
                                                "this worker's server only",
    "FLEETGEN_REDIS_PASSWORD_FILE": "file holding the Redis password (put into REDIS_URL when "
                                    "it has none)",
    "AWS_ENDPOINT_URL": "S3 endpoint (SeaweedFS, MinIO, ...); unset means AWS",
    "AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY / AWS_DEFAULT_REGION": "standard boto3 credentials",
}
