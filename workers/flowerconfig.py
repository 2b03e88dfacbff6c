"""Flower defaults for fleetgen: `celery -A workers flower` loads this file from the installed
package (workers/app.py points Flower at it unless FLOWER_CONF or --conf names another).

Flower reads this file with tornado's `parse_config_file` (module-level names = options) after
its FLOWER_* environment variables and before the command line: a flag wins over a value
here, but FLOWER_PORT or FLOWER_ADDRESS do not (use flags for the options set below).
docs/guides/flower.md has the commands for auth, persistence and running behind a proxy.
"""

import ipaddress

from tornado.options import options as _tornado_options

from fleetgen.ports import busy_reason, port_is_free

# Flower's own default is every interface, and its pages need no login unless auth is set:
# loopback until someone decides otherwise (and then sets --basic-auth, see
# docs/guides/flower.md#access-and-authentication).
address = "127.0.0.1"
port = 5555

# Flower keeps tasks in memory, tracebacks included; its default of 100 000 makes it grow
# for days (mher/flower#1305). It is a window on recent work, not a ledger: the job ledger
# and `python -m producer status` hold the full failure list.
max_tasks = 10000

# The tasks page shows why each batch delivery ended: args name the job and the batch, the
# result says how it ended ({'status': 'done', ...}; 'paused' or 'cancelled' with the job's
# reason for a delivery dropped because its job is held: not a failure), the exception
# column (hidden by default) why one failed. Short columns first, so the reason fits.
tasks_columns = "state,args,result,exception,worker,received,runtime,uuid"


def _loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:  # '' (every interface) or a host name: not known to be loopback
        return False


def _refuse_open_bind() -> None:
    """Flower's pages and API control the workers and show every task's arguments and errors:
    listening beyond loopback without a login would hand them to the network, as compose's
    FLOWER_BASIC_AUTH requirement already refuses to do."""
    o = _tornado_options
    if o.unix_socket or _loopback(o.address) or o.basic_auth or o.auth:
        return
    raise SystemExit(
        f"flower: refusing to listen on {o.address or 'every interface'!r} without a login; "
        "set FLOWER_BASIC_AUTH=user:password (or --auth with an OAuth provider), or bind "
        "127.0.0.1")


def _refuse_taken_port() -> None:
    """A port something else holds would end in tornado's `OSError: [Errno 98]` traceback once
    Flower has started: say who holds it, and how to pick another, before that."""
    o = _tornado_options
    if o.unix_socket or port_is_free(o.port, o.address or "0.0.0.0"):
        return
    raise SystemExit(
        f"flower: port {o.port} is {busy_reason(o.port)}; start Flower on another port with "
        f"--port={o.port + 1} (and open http://{o.address or '127.0.0.1'}:{o.port + 1})")


# Run after the command line has been parsed last (flags included), before Flower listens.
_tornado_options.add_parse_callback(_refuse_open_bind)
_tornado_options.add_parse_callback(_refuse_taken_port)
