"""`--help` of the commands that steer and read a job: one thing has one name across them (the
file written is PATH, a count N, an output URI with its default), and the words match what the
command does (`resume` runs a cancelled job again)."""

from __future__ import annotations

import pytest

from producer.cli import main


def help_of(capsys: pytest.CaptureFixture[str], command: str) -> str:
    with pytest.raises(SystemExit) as done:
        main([command, "--help"])
    assert done.value.code == 0
    return " ".join(capsys.readouterr().out.split())  # argparse's wrapping aside


def test_the_same_flag_has_the_same_name_and_default_in_every_command(
        capsys: pytest.CaptureFixture[str]) -> None:
    export, rebuild, requeue = (help_of(capsys, c) for c in ("export", "rebuild", "requeue"))
    assert "--to PATH" in export and "--batch-size N" in requeue
    output = ("--output URI the job's output, s3://bucket/prefix or a folder (default: the output "
              "Redis has for it)")
    assert output in export and output in rebuild


def test_resume_and_cancel_say_a_cancelled_job_runs_again(
        capsys: pytest.CaptureFixture[str]) -> None:
    assert "Run a paused or cancelled job again." in help_of(capsys, "resume")
    assert "(resume runs it again)" in help_of(capsys, "cancel")
    assert "finished ones until FLEETGEN_JOB_RETENTION expires them" in help_of(capsys, "jobs")
