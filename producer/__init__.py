"""fleetgen's producer: `python -m producer enqueue|status|export|upload|...` (producer/cli.py).

Its errors hang from fleetgen's root, `fleetgen.errors.FleetgenError` (the shared tree in
fleetgen/errors.py); those it adds:

    FleetgenError
      CommandError        a command could not do what was asked (cli.py); printed as one line
      InputError          one bad input line: FILE:LINE: FIELD: what is wrong (producer.inputs)
      InputErrors         several bad lines: the first ones kept, and the count of all
      NoPrompts           the file holds no prompt at all
      UnreadableInput     the input cannot be read as prompts at all (no such file or object,
                          no usable column, a split not named, pyarrow missing)
      UploadError         `upload` cannot do what was asked: no such file, a target that is
                          not S3, no such bucket, an object already there (producer.upload)
      ExportError         the job's outcomes cannot be written in the format asked: an
                          embeddings job's vectors of several lengths in Parquet (producer.export)

`EnqueueInterrupted` (enqueue.py) is no error: it carries Ctrl-C out of an enqueue with the
report of what was stored.
"""
