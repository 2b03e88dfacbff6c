"""Flower defaults for fleetgen: `celery -A workers flower --conf=workers/flowerconfig.py`.

Flower reads this file with tornado's `parse_config_file` (module-level names = options) after
its FLOWER_* environment variables and before the command line: a flag wins over a value
here, but FLOWER_PORT or FLOWER_ADDRESS do not (use flags for the options set below).
README "flower" has the commands for auth, persistence and running behind a proxy.
"""

# Flower's own default is every interface, and its pages need no login unless auth is set:
# loopback until someone decides otherwise (and then sets --basic-auth, see README "flower").
address = "127.0.0.1"
port = 5555

# Flower keeps tasks in memory, tracebacks included; its default of 100 000 makes it grow
# for days (mher/flower#1305). It is a window on recent work, not a ledger: the job ledger
# and `python -m producer status` hold the full failure list.
max_tasks = 10000

# A failed batch shows its reason on the tasks page: the exception column (hidden by default)
# carries the message fleetgen raises, e.g. "JobNotRunningError('job x is paused: ...')", and
# args name the job and the batch. Short columns first, so the reason fits on screen.
tasks_columns = "state,args,exception,worker,received,runtime,uuid"
