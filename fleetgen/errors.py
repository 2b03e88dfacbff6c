"""What can fail, named once. Callers catch these, never httpx/botocore types.

    FleetgenError
      GenerationError        one prompt could not be generated
        RetryableError       a 5xx, a read timeout, a connection reset mid-request, an aborted
                             generation (finish_reason `abort`)
        BadRequestError      a 4xx, e.g. prompt longer than the context: fail, never retry
        RequestHeldError     not sent, or abandoned at a hung server: handed back, no attempt
        ServerDownError      the server refuses connections or is not ready: wait, spend no attempt
          ServerSickError    the server answers but fails what it is sent: out of rotation,
                             its batches handed back, no attempt spent
        OverloadedError      the server is full (429, 503, a queue-full refusal): send again
                             later, spend no attempt
      SinkError              the output location could not be read or written
        SinkUnusableError    this worker cannot write, read or list under a job's output prefix
      LeaseLostError         another worker owns the batch now: stop without writing
      WorkerStoppingError    this worker is shutting down: hand the batch back, spend no attempt
      JobError               unknown job, bad job state or manifest
        UnknownJobError      Redis holds no job of that name
        JobNotRunningError   a batch of a paused or cancelled job was dropped
        JobBusyError         another command holds the job's lock (enqueue, requeue, rebuild)
        ModelChoiceError     the server serves several models and the job names none
        NotHereError         this worker cannot run the job's batches: other workers take them
          RolloutError       the job's rollout cannot be imported here, or is another version
          EndpointError      this worker's server does not serve the job's kind of request
      SettingsError          an environment variable fleetgen cannot use (settings.py)
      WorkerConfigError      the worker cannot tell which server to use (runtime.py)
      PreflightError         the worker cannot work as configured: it refuses to start (preflight.py)
      ExporterError          the worker's /metrics port could not be bound (metrics.py)
      UnusableServerError    nothing listens at the worker's server URL, or what answers is
                             not an OpenAI-compatible server: it waits (discovery.py)

The producer's errors hang from the same root (producer/__init__.py); the launcher has its own
(launcher/__init__.py).
"""

from __future__ import annotations


class FleetgenError(Exception):
    """Base of every error fleetgen raises on purpose."""


class GenerationError(FleetgenError):
    """A request's end that is not an answer; `code` is the record's error code
    (fleetgen/causes.py), None where no reply was classified."""

    def __init__(self, message: str, *, status: int | None = None,
                 code: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.status = status
        self.code = code
        # The tries the request took when it ended in this error (set where its tries end).
        self.tries = 0


class RetryableError(GenerationError):
    """Transient: the same request may succeed if sent again after a pause."""


class BadRequestError(GenerationError):
    """Permanent: the server rejected this request; sending it again cannot help. Its `code`
    says whose fault it is: the prompt's alone, or the job's (causes.job_caused)."""


class RequestHeldError(GenerationError):
    """The request was not sent, or was abandoned unanswered, for a reason that is not the
    prompt's: its worker is stopping (`STOPPING`), its job paused (`PAUSED`), its server out of
    rotation or hung (`OUT`), or the server refuses several answers in one request (`SPLIT`:
    send them one by one). No attempt is spent."""

    PAUSED, STOPPING, OUT, SPLIT = "paused", "stopping", "out of rotation", "split"

    def __init__(self, why: str, detail: str | None = None) -> None:
        super().__init__(f"{why} ({detail})" if detail else why)
        self.why = why


class ServerDownError(GenerationError):
    """The server is not there (restarting, crashed, draining); the prompt is not at fault."""


class ServerSickError(ServerDownError):
    """The server answers `/health` but fails the requests it is sent (5xx, aborts, resets):
    the worker takes it out of rotation, hands its batches back and probes it until it heals."""


class OverloadedError(GenerationError):
    """The server is full and said so (HTTP 429, 503, a queue-full refusal): the request was not
    run, costs no attempt, and is sent again after `retry_after_s` (the server's Retry-After)
    or a backoff."""

    def __init__(self, message: str, *, status: int | None = None,
                 retry_after_s: float | None = None, code: str | None = "overloaded") -> None:
        super().__init__(message, status=status, code=code)
        self.retry_after_s = retry_after_s


class SinkError(FleetgenError):
    """Reading or writing the output location failed."""


class LeaseLostError(FleetgenError):
    """The batch's lease expired or was taken over; this copy must not write."""


class WorkerStoppingError(FleetgenError):
    """This worker is shutting down: its batch goes back to the queue, resumable, no attempt
    spent (requests already at the server finished and are checkpointed)."""


class JobError(FleetgenError):
    """The job does not exist, or the operation does not fit its state."""


class UnknownJobError(JobError):
    """Redis holds no job of that name: a typo, a job whose keys expired after it finished,
    or a Redis that lost its data (the job's output tells the last two apart)."""

    def __init__(self, message: str, job: str) -> None:
        super().__init__(message)
        self.job = job


class JobNotRunningError(JobError):
    """The job is paused or cancelled; its batch waits for `resume`."""


class JobBusyError(JobError):
    """Another command holds the job's lock (an enqueue, a requeue, a rebuild)."""


class ModelChoiceError(JobError):
    """The server serves several models and the prompt names none: the job is paused."""


class SinkUnusableError(SinkError):
    """This worker cannot write, read or list under a job's output prefix."""


class PreflightError(FleetgenError):
    """The worker cannot do its work as configured."""


class NotHereError(JobError):
    """This worker cannot run the job's batches, though others may: they are handed back to
    the shared queue before the lease, no attempt spent."""


class RolloutError(NotHereError):
    """A job's rollout cannot be used here: not importable, not a rollout, or another version
    of its module than the job's (fleetgen/rollouts)."""


class EndpointError(NotHereError):
    """This worker's server does not serve the job's kind of request (fleetgen/endpoints.py):
    an embedding model and a chat or completions job, or a generation model and embeddings."""
