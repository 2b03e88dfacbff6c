"""Safe on a shared GPU node: credentials everywhere, secrets nowhere (docs/security.md).

Each test takes the part of a local user on the same node (any account can reach 127.0.0.1
and read world-readable files) or of someone who can write into Redis, and checks what they
get: the embedded Valkey and S3 answer nobody without credentials, on any port; a server
address planted in the worker registry receives no API key; and a whole run with faults
prints none of the secrets it was given, anywhere a person or another user could look.
"""

from __future__ import annotations

import contextlib
import http.server
import os
import secrets
import socket
import ssl
import stat
import subprocess
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import boto3
import httpx
import orjson
import pytest
import redis
from botocore import UNSIGNED
from botocore.config import Config
from botocore.exceptions import ClientError

import fleetgen.settings
from fleetgen import keys
from fleetgen.fleet import ServerHealth, WorkerEntry
from fleetgen.ledger import Ledger
from fleetgen.poll import wait_until
from fleetgen.ports import free_port
from fleetgen.readings import ServerReading
from fleetgen.redact import redact, redact_argv
from fleetgen.settings import Settings, SettingsError
from launcher.services import ACL_FILE, RedisServer, S3Server
from tests.launcher.services.test_services import listening
from tests.stack import CELERY, PYTHON, ROOT, Proc, Stack, chat_rows, wait_job_done, write_jsonl

pytestmark = pytest.mark.e2e

H2_PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + b"\x00\x00\x00\x04\x00\x00\x00\x00\x00"
H2_SETTINGS = 0x4


def cmdline(pid: int) -> str:
    return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()


def mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


# --- one function masks every secret a person may see -----------------------------------------


def test_redact_masks_url_passwords_secret_query_values_and_secret_settings_only() -> None:
    text = ("cannot reach redis://:hunter2@10.0.0.5:6379/0 nor rediss://fleet:pa%40ss@r:6380/1; "
            "GET https://s3.local/b/k?X-Amz-Credential=AKIA&X-Amz-Signature=f00d&part=2 "
            "and http://tok3n@proxy:8080/v1")
    shown = redact(text)
    for secret in ("hunter2", "pa%40ss", "f00d", "AKIA", "tok3n"):
        assert secret not in shown
    for kept in ("10.0.0.5:6379/0", "rediss://fleet:***@r:6380/1", "part=2", "proxy:8080/v1"):
        assert kept in shown
    assert redact("s3cr3t", name="AWS_SECRET_ACCESS_KEY") == "***"
    assert redact("s3cr3t", name="FLEETGEN_SERVER_API_KEY") == "***"
    assert redact("fleetgen", name="AWS_ACCESS_KEY_ID") == "fleetgen"
    assert redact("redis://127.0.0.1:6389/0") == "redis://127.0.0.1:6389/0"


def test_a_command_line_is_shown_with_every_secret_flag_and_url_credential_masked() -> None:
    argv = ["python", "-m", "sglang.launch_server", "--api-key", "k-123", "--admin-api-key=adm-456",
            "--ssl-keyfile-password", "pem-789", "--model-path", "s3://u:sk-000@store/models/m",
            "--enable-auth", "--port", "30000", "--ssl-keyfile", "/etc/key.pem"]
    shown = redact_argv(argv)
    for secret in ("k-123", "adm-456", "pem-789", "sk-000"):
        assert not any(secret in word for word in shown), shown
    # Everything else stays as given: a bare switch does not swallow the next flag.
    assert shown[shown.index("--enable-auth") + 1:] == ["--port", "30000", "--ssl-keyfile",
                                                         "/etc/key.pem"]
    assert argv[4] == "k-123"  # the caller's list is left alone


def test_settings_never_show_the_redis_password_or_the_api_key(tmp_path: Path) -> None:
    password = tmp_path / "password"
    password.write_text("pw-from-file\n")
    settings = Settings.from_env({"REDIS_URL": "redis://127.0.0.1:7000/2",
                                  "FLEETGEN_REDIS_PASSWORD_FILE": str(password),
                                  "FLEETGEN_SERVER_API_KEY": "key-123"})
    assert settings.redis_url == "redis://:pw-from-file@127.0.0.1:7000/2"
    assert "pw-from-file" not in repr(settings) and "key-123" not in repr(settings)
    with pytest.raises(SettingsError, match=r"http://u:\*\*\*@gpu0:30000") as refused:
        Settings(server_url="http://u:hidden@gpu0:30000")
    assert "hidden" not in str(refused.value)
    with pytest.raises(SettingsError, match="no such secret file"):
        Settings.from_env({"FLEETGEN_REDIS_PASSWORD_FILE": str(tmp_path / "missing")})


def test_next_to_the_embedded_redis_its_password_file_is_found_without_a_setting(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    # Not the clone's own embedded Redis, which a developer may have running beside the tests.
    monkeypatch.setattr(fleetgen.settings, "PROJECT_DIR", tmp_path / "no-clone")
    assert Settings.from_env({}).redis_url == "redis://127.0.0.1:6389/0"
    (tmp_path / ".fleetgen" / "redis").mkdir(parents=True)
    (tmp_path / ".fleetgen" / "redis" / "password").write_text("embedded-pw\n")
    assert Settings.from_env({}).redis_url == "redis://:embedded-pw@127.0.0.1:6389/0"
    # Another Redis named in REDIS_URL never gets the embedded one's password.
    assert Settings.from_env({"REDIS_URL": "redis://10.0.0.5:6379/0"}).redis_url == \
        "redis://10.0.0.5:6379/0"


def test_the_producer_names_redis_without_its_password_when_it_is_refused_or_unreachable(
    redis_server: RedisServer, redis_url: str
) -> None:
    wrong = f"redis://:wrong-{secrets.token_hex(8)}@127.0.0.1:{redis_server.port}/0"
    unreachable = redis_url.replace(f":{redis_server.port}/", f":{free_port()}/")
    for url, says in ((wrong, "refused the password that was given"),
                      (unreachable, "cannot reach Redis")):
        result = subprocess.run(
            [PYTHON, "-m", "producer", "jobs"], cwd=ROOT,
            env={**os.environ, "REDIS_URL": url}, capture_output=True, text=True, timeout=60,
            check=False)
        assert result.returncode == 1, result.stderr
        assert says in result.stderr and "redis://:***@127.0.0.1:" in result.stderr
        assert url.split("@")[0].split(":")[-1] not in result.stdout + result.stderr


def test_the_producer_says_redis_needs_a_password_when_none_was_given(
    redis_server: RedisServer,
) -> None:
    """Not "refused the password": none was sent."""
    bare = f"redis://127.0.0.1:{redis_server.port}/0"
    env = {k: v for k, v in os.environ.items() if k != "FLEETGEN_REDIS_PASSWORD_FILE"}
    result = subprocess.run([PYTHON, "-m", "producer", "jobs"], cwd=ROOT,
                            env={**env, "REDIS_URL": bare}, capture_output=True, text=True,
                            timeout=60, check=False)
    assert result.returncode == 1, result.stderr
    assert result.stderr.startswith(f"error: Redis at {bare} needs a password and none was given")
    assert "REDIS_URL (redis://:PASSWORD@HOST:PORT/0)" in result.stderr
    assert "FLEETGEN_REDIS_PASSWORD_FILE=" in result.stderr
    assert "refused" not in result.stderr


# --- the embedded Valkey ------------------------------------------------------------------------


def test_embedded_valkey_refuses_every_client_without_its_password(
    redis_server: RedisServer,
) -> None:
    for client in (redis.Redis(port=redis_server.port),
                   redis.Redis(port=redis_server.port, password="guess"),
                   redis.Redis(port=redis_server.port, username="admin", password="admin")):
        with pytest.raises(redis.AuthenticationError):
            client.ping()
        client.close()
    # The raw protocol too: no command runs before AUTH.
    with socket.create_connection(("127.0.0.1", redis_server.port), timeout=5) as raw:
        raw.sendall(b"KEYS *\r\n")
        assert raw.recv(200).startswith(b"-NOAUTH")
    owner = redis_server.client()
    assert owner.ping() and owner.config_get("protected-mode") == {"protected-mode": "yes"}
    owner.close()


def test_embedded_valkey_keeps_its_password_in_private_files_and_off_its_command_line(
    redis_server: RedisServer,
) -> None:
    assert redis_server.pid is not None
    password = redis_server.credentials_file.read_text().strip()
    assert len(password) >= 40
    assert password not in cmdline(redis_server.pid)
    assert mode(redis_server.data_dir) == 0o700
    assert mode(redis_server.credentials_file) == 0o600
    acl = redis_server.data_dir / ACL_FILE
    assert mode(acl) == 0o600 and password not in acl.read_text()
    assert password not in redis_server.log_path.read_text()


def test_launcher_redis_makes_a_password_at_first_start_and_keeps_it_and_acl_users(
    tmp_path: Path, valkey_bin: Path
) -> None:
    data = tmp_path / "redis"
    with RedisServer(data_dir=data) as first:
        password = first.password
        owner = first.client()
        # A least-privilege user, saved as an operator would (docs/security.md).
        owner.execute_command("ACL", "SETUSER", "reader", "on", ">reader-pw", "~fg:*", "+get")
        owner.execute_command("ACL", "SAVE")
        owner.set("fg:x", "1")
        owner.close()
    with RedisServer(data_dir=data) as again:
        assert again.password == password
        reader = redis.Redis(port=again.port, username="reader", password="reader-pw")
        assert reader.get("fg:x") == b"1"
        with pytest.raises(redis.exceptions.NoPermissionError):
            reader.set("fg:x", "2")
        reader.close()


# --- the embedded S3 ----------------------------------------------------------------------------


@pytest.fixture
def stored(s3_server: S3Server, s3_client: Any) -> Iterator[tuple[str, bytes]]:
    """An object in the bucket, as a worker would have written it."""
    key, body = "runs/job/results/b000001.jsonl", b'{"id": "q1", "content": "private answer"}\n'
    s3_client.put_object(Bucket=s3_server.bucket, Key=key, Body=body)
    yield key, body


def test_embedded_s3_refuses_unsigned_and_wrongly_signed_requests(
    s3_server: S3Server, stored: tuple[str, bytes]
) -> None:
    key, _ = stored
    anonymous = boto3.session.Session().client(
        "s3", endpoint_url=s3_server.endpoint_url, region_name="us-east-1",
        config=Config(signature_version=UNSIGNED, s3={"addressing_style": "path"}))
    wrong_secret = S3Server(data_dir=s3_server.data_dir, port=s3_server.port,
                            access_key=s3_server.access_key, secret_key="guess").client()
    for client in (anonymous, wrong_secret):
        for call in (lambda c=client: c.get_object(Bucket=s3_server.bucket, Key=key),
                     lambda c=client: c.list_objects_v2(Bucket=s3_server.bucket),
                     lambda c=client: c.put_object(Bucket=s3_server.bucket, Key=key, Body=b"x")):
            with pytest.raises(ClientError) as refused:
                call()
            assert refused.value.response["ResponseMetadata"]["HTTPStatusCode"] == 403
        client.close()


def test_embedded_s3_master_volume_filer_and_admin_http_ports_refuse_without_credentials(
    s3_server: S3Server, s3_client: Any, stored: tuple[str, bytes]
) -> None:
    key, body = stored
    p = s3_server.port
    master, volume, filer, admin = (f"http://127.0.0.1:{p + n}" for n in (2, 4, 6, 8))
    path = f"/buckets/{s3_server.bucket}/{key}"
    with httpx.Client(timeout=10) as http:
        # The filer's HTTP API would list, read and overwrite any object.
        for method, url in (("GET", f"{filer}{path}"), ("GET", f"{filer}/buckets/"),
                            ("DELETE", f"{filer}{path}")):
            answer = http.request(method, url)
            assert answer.status_code in (401, 403, 404), (method, url, answer.status_code)
            assert body not in answer.content
        tamper = http.post(f"{filer}{path}", files={"file": b"tampered"})
        assert tamper.status_code in (401, 403, 404)
        # The master's would hand out write slots and delete a bucket's whole data.
        for url in (f"{master}/dir/assign", f"{master}/col/delete?collection={s3_server.bucket}",
                    f"{master}/vol/grow?count=1", f"{master}/dir/lookup?volumeId=1"):
            assert http.get(url).status_code in (401, 403, 404), url
        # The volume server's wants the JWT only the master and filer can sign.
        for url in (f"{volume}/1,01", f"{volume}/ui/index.html", f"{volume}/"):
            assert http.get(url).status_code == 401, url
        assert http.post(f"{volume}/1,01", files={"file": b"x"}).status_code == 401
        # The admin UI and its API want a login.
        assert http.get(f"{admin}/api/cluster/topology").status_code == 401
        assert http.get(f"{admin}/files").status_code in (302, 303, 307)
        assert http.post(f"{admin}/login", data={"username": "admin", "password": "admin"}
                         ).headers.get("location", "").startswith("/login")
    assert s3_client.get_object(Bucket=s3_server.bucket, Key=key)["Body"].read() == body


def test_embedded_s3_admin_login_works_with_the_generated_password(s3_server: S3Server) -> None:
    admin = f"http://127.0.0.1:{s3_server.port + 8}"
    with httpx.Client(timeout=10) as http:
        form = http.get(f"{admin}/login").text
        token = form.split('name="csrf_token" value="', 1)[1].split('"', 1)[0]
        password = s3_server.admin_password_file.read_text().strip()
        login = http.post(f"{admin}/login", data={"username": "admin", "password": password,
                                                  "csrf_token": token})
        assert login.headers["location"].endswith("/admin")
        assert http.get(f"{admin}/api/cluster/topology").status_code == 200


def grpc_settings_frame(port: int, server: S3Server, *, present_certificate: bool,
                        tls: bool = True) -> bool:
    """Whether the gRPC server on `port` answers an HTTP/2 preface with its SETTINGS frame."""
    with socket.create_connection(("127.0.0.1", port), timeout=5) as raw:
        try:
            if not tls:
                raw.sendall(H2_PREFACE)
                head = raw.recv(9)
                return len(head) == 9 and head[3] == H2_SETTINGS
            context = ssl.create_default_context(cafile=str(server.tls.ca))
            context.set_alpn_protocols(["h2"])
            if present_certificate:
                context.load_cert_chain(str(server.tls.cert), str(server.tls.key))
            with context.wrap_socket(raw, server_hostname="127.0.0.1") as sock:
                sock.sendall(H2_PREFACE)
                head = sock.recv(9)
                return len(head) == 9 and head[3] == H2_SETTINGS
        except (ssl.SSLError, ConnectionError, TimeoutError):
            return False


def test_embedded_s3_grpc_ports_serve_only_clients_with_the_node_certificate(
    s3_server: S3Server,
) -> None:
    # The filer's and master's gRPC APIs are `weed shell`'s way in: read, write, delete all.
    for name, port in s3_server.ports.grpc.items():
        assert not grpc_settings_frame(port, s3_server, present_certificate=False, tls=False), name
        assert not grpc_settings_frame(port, s3_server, present_certificate=False), name
        assert grpc_settings_frame(port, s3_server, present_certificate=True), name
    # weed also serves some of them on unix sockets in /tmp: owner-only (0755), and TLS too.
    sockets = [path for path in s3_server.ports.grpc_sockets() if path.exists()]
    assert sockets, "weed made no gRPC socket in /tmp: update this test"
    for path in sockets:
        assert mode(path) & 0o022 == 0, path
        with socket.socket(socket.AF_UNIX) as unix:
            unix.settimeout(5)
            unix.connect(str(path))
            unix.sendall(H2_PREFACE)
            try:
                head = unix.recv(9)
            except (ConnectionError, TimeoutError):
                head = b""
            assert not (len(head) == 9 and head[3] == H2_SETTINGS), path


def test_embedded_s3_keeps_its_secrets_in_private_files_and_off_its_command_line(
    s3_server: S3Server,
) -> None:
    assert s3_server.pid is not None
    argv = cmdline(s3_server.pid)
    admin_password = s3_server.admin_password_file.read_text().strip()
    for secret in (s3_server.secret_key, admin_password):
        assert len(secret) >= 40 and secret not in argv
    assert mode(s3_server.data_dir) == 0o700
    for path in (s3_server.credentials_file, s3_server.admin_password_file, s3_server.tls.key,
                 s3_server.data_dir / "security.toml", s3_server.data_dir / "mini.options"):
        assert mode(path) == 0o600, path
    assert admin_password not in (s3_server.data_dir / "mini.options").read_text(), \
        "weed rewrites mini.options once up: the password must not stay in it"
    log = s3_server.log_path.read_text()
    assert s3_server.secret_key not in log and admin_password not in log


# --- the bucket must exist ----------------------------------------------------------------------


def test_a_mistyped_bucket_is_refused_by_s3_and_by_enqueue_before_anything_is_written(
    tmp_path: Path, s3_server: S3Server, s3_client: Any, s3_env: dict[str, str],
    redis_url: str, redis_client: Any,
) -> None:
    typo = f"{s3_server.bucket}-typo"
    with pytest.raises(ClientError) as refused:
        s3_client.put_object(Bucket=typo, Key="x", Body=b"x")
    assert refused.value.response["Error"]["Code"] == "NoSuchBucket"
    stack = Stack(tmp_path, {"REDIS_URL": redis_url, **s3_env})
    prompts = write_jsonl(tmp_path / "in.jsonl", chat_rows(5))
    result = stack.producer("enqueue", str(prompts), "--job", "typo", "--output",
                            f"s3://{typo}/runs", check=False)
    assert result.returncode == 1
    assert f"s3://{typo} at {s3_server.endpoint_url}: no such bucket" in result.stderr
    assert not Ledger.from_url(redis_url).jobs.exists("typo")
    with pytest.raises(ClientError):
        s3_client.head_bucket(Bucket=typo)


# --- Flower -------------------------------------------------------------------------------------


def flower(stack: Stack, address: str, env: dict[str, str]) -> tuple[Proc, int]:
    port = free_port()
    argv = [CELERY, "-A", "workers", "flower", "--conf=workers/flowerconfig.py",
            f"--address={address}", f"--port={port}"]
    clean = {k: v for k, v in stack.env(env).items() if not k.startswith("FLOWER_") or k in env}
    proc = Proc(f"flower-{address}", argv, clean, stack.tmp / f"flower-{port}.log").start()
    stack.procs.append(proc)
    return proc, port


def test_flower_refuses_to_listen_beyond_loopback_without_a_login(
    tmp_path: Path, redis_url: str, redis_client: Any
) -> None:
    stack = Stack(tmp_path, {"REDIS_URL": redis_url})
    try:
        refused, _ = flower(stack, "0.0.0.0", {})
        assert refused.popen is not None and refused.popen.wait(60) != 0
        assert "refusing to listen on '0.0.0.0' without a login" in refused.log()
        user = f"fleet:{secrets.token_hex(8)}"
        allowed, port = flower(stack, "0.0.0.0", {"FLOWER_BASIC_AUTH": user})

        def healthy() -> bool:
            assert allowed.alive(), allowed.log()
            try:
                return httpx.get(f"http://127.0.0.1:{port}/healthcheck", timeout=2).text == "OK"
            except httpx.HTTPError:
                return False

        wait_until(healthy, 60, what="flower with a login up")
        assert httpx.get(f"http://127.0.0.1:{port}/api/workers", timeout=10).status_code == 401
    finally:
        stack.close()


# --- keys go only where they belong -------------------------------------------------------------


class Listener:
    """An HTTP server the test controls: records every request, answers like a keyed SGLang."""

    def __init__(self) -> None:
        self.requests: list[tuple[str, dict[str, str]]] = []
        outer = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                outer.requests.append((self.path, {k.lower(): v for k, v in self.headers.items()}))
                ok = self.path.startswith("/metrics") or self.path.startswith("/health")
                body = b"" if ok else b'{"error": "Unauthorized"}'
                self.send_response(200 if ok else 401)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args: Any) -> None:
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def listener() -> Iterator[Listener]:
    spy = Listener()
    yield spy
    spy.close()


def plant(r: Any, server: str) -> None:
    """A registry entry as anyone with write access to Redis could write it."""
    entry = WorkerEntry(
        worker="gpu9@planted", host=socket.gethostname(), pid=1, queues=["gpu9"],
        last_error=None, server=server, local_server=server,
        reading=ServerReading("up"), state="ready", server_kind=None,
        effective_max_running_requests=None, requested_max_running_requests=None,
        capacity_source=None, limit=1, in_flight=0, updated=time.time(),
        health=ServerHealth.quiet())
    r.hset(keys.WORKERS, "gpu9@planted", entry.to_json())


def test_a_server_planted_in_the_registry_gets_no_key_from_status_nor_a_request_from_the_progress_writer(
    stack: Stack, tmp_path: Path, redis_client: Any, listener: Listener,
) -> None:
    key = f"sglang-key-{secrets.token_hex(12)}"
    plant(redis_client, listener.url)
    _, url = stack.sim("sim0", "--api-key", key, "--max-running-requests", "8",
                       "--decode-tps", "200", "--mean-output-tokens", "40", "--speed", "20")
    stack.worker(0, url, {"FLEETGEN_SERVER_API_KEY": key})
    out = tmp_path / "out"
    prompts = write_jsonl(tmp_path / "in.jsonl", chat_rows(20))
    stack.producer("enqueue", str(prompts), "--job", "planted", "--output", str(out),
                   "--batch-size", "5")
    # The worker's reconciler writes progress.json from the ledger alone: no server is read.
    wait_until(lambda: (out / "planted" / "progress.json").exists(), 60,
               what="progress.json written by the worker")
    assert not listener.requests, "the progress writer read the planted server"
    # `status` (text and --json), run by a user with the key in their environment.
    keyed = {**os.environ, **stack.base_env, "FLEETGEN_SERVER_API_KEY": key}
    for flags in ((), ("--json",)):
        subprocess.run([PYTHON, "-m", "producer", "status", "planted", *flags], cwd=ROOT,
                       env=keyed, capture_output=True, timeout=60, check=True)
    assert listener.requests, "status never read the planted server"
    for path, headers in listener.requests:
        assert "authorization" not in headers, path
        assert key not in repr(headers), path
    progress = orjson.loads((out / "planted" / "progress.json").read_bytes())
    mine = next(row for row in progress["fleet"] if row["worker"] == "gpu0@test")
    # The worker's own keyed server still shows its capacity: from the worker's reading.
    assert mine["effective_max"] == 8 and mine["requested_max"] == 8
    entry = orjson.loads(redis_client.hget(keys.WORKERS, "gpu0@test"))
    assert key not in orjson.dumps(entry).decode()


# --- a whole run with faults shows none of the secrets it was given -----------------------------


def redis_dump(r: Any) -> str:
    """Every key and value in Redis, as text."""
    parts = []
    for name in r.scan_iter(count=1000):
        kind = r.type(name).decode()
        value: Any = {
            "string": lambda n: r.get(n), "hash": lambda n: r.hgetall(n),
            "list": lambda n: r.lrange(n, 0, -1), "set": lambda n: r.smembers(n),
            "zset": lambda n: r.zrange(n, 0, -1, withscores=True),
        }.get(kind, lambda n: b"")(name)
        parts.append(f"{name!r} {value!r}")
    return "\n".join(parts)


def test_no_planted_secret_shows_in_any_log_status_file_page_or_redis_after_a_run_with_faults(
    stack: Stack, tmp_path: Path, redis_server: RedisServer, s3_server: S3Server,
    s3_client: Any, redis_client: Any,
) -> None:
    planted = {
        "redis password": redis_server.password,
        "aws secret": s3_server.secret_key,
        "sglang key": f"sglang-key-{secrets.token_hex(12)}",
        "flower password": f"flower-pw-{secrets.token_hex(12)}",
        "wrong redis password": f"wrong-pw-{secrets.token_hex(12)}",
    }
    sglang_key = planted["sglang key"]
    _, url = stack.sim("sim0", "--api-key", sglang_key, "--fail-rate", "0.3",
                       "--max-running-requests", "8", "--decode-tps", "200",
                       "--mean-output-tokens", "40", "--speed", "20")
    metrics_port = free_port()
    stack.worker(0, url, {"FLEETGEN_SERVER_API_KEY": sglang_key, "FLEETGEN_PROMPT_MAX_ATTEMPTS": "1",
                          "FLEETGEN_METRICS_PORT": str(metrics_port)})
    flower_proc, flower_port = flower(stack, "127.0.0.1", {
        "FLOWER_BASIC_AUTH": f"fleet:{planted['flower password']}", "FLEETGEN_SERVER_API_KEY": sglang_key})
    base = f"http://127.0.0.1:{flower_port}"

    def flower_up() -> bool:
        assert flower_proc.alive(), flower_proc.log()
        try:
            return httpx.get(f"{base}/healthcheck", timeout=2).status_code == 200
        except httpx.HTTPError:
            return False

    # Up before the job, so that it sees every task's events.
    wait_until(flower_up, 60, what="flower up")
    keyed = {**os.environ, **stack.base_env, "FLEETGEN_SERVER_API_KEY": sglang_key}

    def producer(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
        return subprocess.run([PYTHON, "-m", "producer", *args], cwd=ROOT, env=env or keyed,
                              capture_output=True, text=True, timeout=120, check=False)

    prompts = write_jsonl(tmp_path / "in.jsonl", chat_rows(40))
    output = f"s3://{s3_server.bucket}/runs"
    shown: dict[str, str] = {}
    enqueued = producer("enqueue", str(prompts), "--job", "planted", "--output", output,
                        "--batch-size", "10")
    assert enqueued.returncode == 0, enqueued.stderr
    shown["enqueue"] = enqueued.stdout + enqueued.stderr
    status = wait_job_done(stack, "planted", 180)
    assert status.failed > 0 and status.done > 0, "the run must have had faults and answers"
    prefix = "runs/planted/"
    wait_until(lambda: bool(s3_client.list_objects_v2(Bucket=s3_server.bucket,
                                                      Prefix=f"{prefix}progress.json")
                            .get("KeyCount")), 60, what="progress.json in the bucket")
    for args in (("status", "planted"), ("status", "planted", "--json"), ("jobs",),
                 ("export", "planted", "--to", str(tmp_path / "export.jsonl"))):
        result = producer(*args)
        assert result.returncode == 0, result.stderr
        shown[" ".join(args)] = result.stdout + result.stderr
    shown["export file"] = (tmp_path / "export.jsonl").read_text()
    # Error paths: a wrong password, and an unreachable Redis with the right one in its URL.
    wrong = f"redis://:{planted['wrong redis password']}@127.0.0.1:{redis_server.port}/0"
    gone = redis_server.url.replace(f":{redis_server.port}/", f":{free_port()}/")
    for name, broken in (("wrong password", wrong), ("unreachable", gone)):
        result = producer("status", "planted", env={**keyed, "REDIS_URL": broken})
        assert result.returncode == 1 and "redis://:***@127.0.0.1" in result.stderr
        shown[f"status with a {name}"] = result.stdout + result.stderr
    # Everything the run left in the bucket: manifest, progress.json, inputs, results, errors.
    objects = [o["Key"] for o in s3_client.list_objects_v2(Bucket=s3_server.bucket,
                                                           Prefix=prefix)["Contents"]]
    assert any("/errors/" in k for k in objects), "the faults must have left error files"
    for name in objects:
        obj = s3_client.get_object(Bucket=s3_server.bucket, Key=name)
        shown[name] = obj["Body"].read().decode()
    shown["worker metrics"] = httpx.get(f"http://127.0.0.1:{metrics_port}/metrics", timeout=10).text
    flower_auth = ("fleet", planted["flower password"])
    for page in ("/api/tasks", "/tasks", "/broker", "/api/workers"):
        answer = httpx.get(f"{base}{page}", auth=flower_auth, timeout=30)
        assert answer.status_code == 200, (page, answer.status_code)
        shown[f"flower {page}"] = answer.text
    assert "redis://:**@127.0.0.1" in shown["flower /broker"], "flower masks the broker URL"
    assert orjson.loads(shown["flower /api/tasks"]), "flower saw the tasks"
    shown["redis"] = redis_dump(redis_client)
    # Every listener the run opened (server, worker metrics, Flower) is on loopback only.
    opened = {proc.name: listening(proc.pid) for proc in stack.procs}
    assert all(opened.values()) and {ip for ports in opened.values() for ip, _ in ports} == {
        "127.0.0.1"}, opened
    for proc in stack.procs:
        if proc.name != "sim0":
            shown[f"log of {proc.name}"] = proc.log_path.read_text(errors="replace")
    shown["valkey log"] = redis_server.log_path.read_text(errors="replace")
    shown["weed log"] = s3_server.log_path.read_text(errors="replace")
    # The simulator logs its server_args as SGLang does, and SGLang prints its own --api-key
    # there (sgl-project/sglang#37457): that log is SGLang's, kept in a private run dir by
    # `launcher up`. It must still hold none of fleetgen's own secrets.
    sim_log = next(p for p in stack.procs if p.name == "sim0").log_path.read_text()
    shown["log of sim0 (but its own key)"] = sim_log.replace(sglang_key, "")
    leaks = [f"{secret_name} in {where}" for where, text in shown.items()
             for secret_name, secret in planted.items() if secret in text]
    assert not leaks, leaks


# --- least privilege: the documented Redis ACL users run a fleet -------------------------------


def documented_acl_rules() -> dict[str, list[str]]:
    """role -> ACL SETUSER arguments, as docs/security.md gives them (passwords to fill in)."""
    rules = {}
    for line in (ROOT / "docs" / "security.md").read_text().splitlines():
        if line.startswith("ACL SETUSER fleetgen-"):
            _, _, user, *args = line.split()
            rules[user.removeprefix("fleetgen-")] = args
    return rules


def test_the_documented_acl_users_run_a_job_and_flower_cannot_read_the_ledger(
    stack: Stack, tmp_path: Path, redis_server: RedisServer, redis_client: Any,
) -> None:
    rules = documented_acl_rules()
    assert set(rules) == {"worker", "producer", "flower"}
    urls = {}
    redis_client.execute_command("ACL", "LOG", "RESET")
    for role, args in rules.items():
        password = secrets.token_hex(16)
        filled = [f">{password}" if a.startswith(">") else a for a in args]
        redis_client.execute_command("ACL", "SETUSER", f"fleetgen-{role}", "reset", *filled)
        urls[role] = f"redis://fleetgen-{role}:{password}@127.0.0.1:{redis_server.port}/0"
    try:
        stack.base_env["REDIS_URL"] = urls["producer"]
        _, url = stack.sim("sim0", "--fail-rate", "0.3", "--max-running-requests", "8",
                           "--decode-tps", "200", "--mean-output-tokens", "40", "--speed", "20")
        stack.worker(0, url, {"REDIS_URL": urls["worker"], "FLEETGEN_PROMPT_MAX_ATTEMPTS": "1"})
        flower_proc, port = flower(stack, "127.0.0.1", {"REDIS_URL": urls["flower"],
                                                         "FLOWER_UNAUTHENTICATED_API": "true"})

        def flower_up() -> bool:
            assert flower_proc.alive(), flower_proc.log()
            try:
                return httpx.get(f"http://127.0.0.1:{port}/healthcheck", timeout=2).text == "OK"
            except httpx.HTTPError:
                return False

        wait_until(flower_up, 60, what="flower up")
        prompts = write_jsonl(tmp_path / "in.jsonl", chat_rows(20))
        out = str(tmp_path / "out")
        stack.producer("enqueue", str(prompts), "--job", "acl", "--output", out,
                       "--batch-size", "5")
        status = wait_job_done(stack, "acl", 120)
        assert status.failed > 0
        for command in (("status", "acl", "--json"), ("jobs",), ("pause", "acl"),
                        ("resume", "acl"), ("cancel", "acl"), ("resume", "acl"),
                        ("requeue", "acl", "--failed"),
                        ("export", "acl", "--to", str(tmp_path / "acl.jsonl"), "--partial")):
            stack.producer(*command)
        wait_job_done(stack, "acl", 120)
        workers = httpx.get(f"http://127.0.0.1:{port}/api/workers", timeout=30).json()
        assert "registered" in workers["gpu0@test"], "flower's inspect answers must get through"
        assert httpx.get(f"http://127.0.0.1:{port}/api/tasks", timeout=30).json()
        assert "CLIENT LIST refused" not in stack.logs()
        denied = [(e["username"], e["reason"], e["object"]) for e in redis_client.acl_log(100)]
        assert not denied, denied
        flower_client = redis.Redis.from_url(urls["flower"])
        for read in (lambda: flower_client.hgetall(keys.WORKERS),
                     lambda: flower_client.hgetall(keys.job("acl"))):
            with pytest.raises(redis.exceptions.NoPermissionError):
                read()
        flower_client.close()
    finally:
        for role in rules:
            redis_client.execute_command("ACL", "DELUSER", f"fleetgen-{role}")


# --- what already held, and must keep holding ---------------------------------------------------


class TouchOnUnpickle:
    """Unpickling it creates a file: proof that a pickled message was decoded."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def __reduce__(self) -> tuple[Any, tuple[Any, ...]]:
        return (Path.touch, (self.path,))


def test_a_pickled_message_is_refused_by_the_worker_unopened(
    stack: Stack, tmp_path: Path, redis_url: str,
) -> None:
    from kombu import Connection

    _, url = stack.sim("sim0")
    worker = stack.worker(0, url)
    marker = tmp_path / "unpickled"
    with Connection(redis_url) as connection:
        connection.Producer(serializer="pickle").publish(
            TouchOnUnpickle(marker), routing_key="gpu0", exchange="",
            headers={"task": keys.TASK_RUN_BATCH, "id": "pickled-1", "lang": "py"})
    wait_until(lambda: "untrusted content" in worker.log() or not worker.alive(), 60,
               what="the worker to refuse the pickled message")
    assert worker.alive() and not marker.exists()
    assert "application/x-python-serialize" in worker.log()


def test_job_names_that_could_reach_other_keys_are_refused(
    tmp_path: Path, redis_url: str, redis_client: Any,
) -> None:
    stack = Stack(tmp_path, {"REDIS_URL": redis_url})
    prompts = write_jsonl(tmp_path / "in.jsonl", chat_rows(3))
    for name in ("x:*", "a:stats", "../up", "fg:job:b", " lead"):
        result = stack.producer("enqueue", str(prompts), "--job", name, "--output",
                                str(tmp_path / "out"), check=False)
        assert result.returncode != 0 and "job name" in result.stderr, (name, result.stderr)
    assert redis_client.dbsize() == 0


class TlsFront:
    """A TLS endpoint in front of the embedded (plain) Valkey, with a certificate from a CA
    that no client trusts unless told to: what a `rediss://` Redis with its own CA looks like."""

    def __init__(self, backend_port: int, certificate: Any) -> None:
        self.backend_port = backend_port
        self.context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        self.context.load_cert_chain(str(certificate.cert), str(certificate.key))
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                raw, _ = self.listener.accept()
            except OSError:
                return
            threading.Thread(target=self._serve, args=(raw,), daemon=True).start()

    def _serve(self, raw: socket.socket) -> None:
        try:
            front = self.context.wrap_socket(raw, server_side=True)
        except (ssl.SSLError, OSError):
            raw.close()  # the client refused our certificate: the point of the test
            return
        back = socket.create_connection(("127.0.0.1", self.backend_port))
        replies = threading.Thread(target=self._pipe, args=(back, front), daemon=True)
        replies.start()
        self._pipe(front, back)
        replies.join(10)
        front.close()
        back.close()

    @staticmethod
    def _pipe(src: socket.socket, dst: socket.socket) -> None:
        try:
            while data := src.recv(65536):
                dst.sendall(data)
        except OSError:
            pass
        finally:
            for sock in (src, dst):
                with contextlib.suppress(OSError):
                    sock.shutdown(socket.SHUT_RDWR)

    def close(self) -> None:
        self.listener.close()


def test_rediss_keeps_certificate_checks_on(tmp_path: Path, redis_server: RedisServer) -> None:
    from launcher.services import issue_node_certificate

    tls = issue_node_certificate(tmp_path / "tls")
    front = TlsFront(redis_server.port, tls)
    try:
        url = redis_server.url.replace("redis://", "rediss://").replace(
            f":{redis_server.port}/", f":{front.port}/")
        for redis_url, code, says in ((url, 1, "CERTIFICATE_VERIFY_FAILED"),
                                      (f"{url}?ssl_ca_certs={tls.ca}", 0, "no jobs")):
            result = subprocess.run([PYTHON, "-m", "producer", "jobs"], cwd=ROOT,
                                    env={**os.environ, "REDIS_URL": redis_url},
                                    capture_output=True, text=True, timeout=60, check=False)
            assert result.returncode == code and says in result.stdout + result.stderr, result
    finally:
        front.close()
