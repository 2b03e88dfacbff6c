"""fleetgen's domain: the job's state, the pieces every process shares, and the operator's views.

The producer, the Celery worker (`workers`) and the launcher all stand on this package; it
imports none of them, and no Celery outside the broker's two modules.

    state        keys (every Redis key, queue name and job-hash field), ledger (the package
                 that talks to Redis for the job's state) and liveledger (its asyncio side, on
                 a worker's loop), job (the manifest), records, checkpoints, sink (S3 or a
                 folder: the source of truth), creation (job locks), breaker and canary (when a
                 job pauses itself)
    broker       broker (the Celery configuration, kombu's transports), dispatch (publishing
                 batches, finding the ones the broker holds)
    servers      the engines fleetgen talks to (SGLang, vLLM, any OpenAI-compatible server),
                 server_info (SGLang's /server_info), readings (a server's live figures)
    views        jobview (one job's status), fleet (the workers' registry), progress
                 (progress.json in the output)
    common       settings (the one settings object), errors, retry (the one backoff),
                 redact, commandline, redisconn, advertise
"""
