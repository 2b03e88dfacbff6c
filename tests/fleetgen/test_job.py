"""Batch boundaries: a pure function of the job, tapered at the end."""

from __future__ import annotations

import pytest

from fleetgen.job import TAPER, GenerationParams, InputInfo, JobManifest, batch_sizes


@pytest.mark.parametrize(("prompts", "size"), [(5000, 79), (500, 48), (60, 10), (1, 48), (0, 48),
                                               (1_000_000, 256), (777, 13)])
def test_batches_cover_every_prompt_once_and_never_exceed_the_size(prompts: int, size: int) -> None:
    sizes = batch_sizes(prompts, size, taper=True)
    assert sum(sizes) == prompts
    assert all(0 < s <= size for s in sizes)


def test_the_last_eighth_of_a_job_goes_out_in_quarter_size_batches() -> None:
    sizes = batch_sizes(5000, 80, taper=True)  # tail: 5000 // 8 = 625 = 31 x 20 + 5
    assert sizes[-32:] == [20] * 31 + [5]
    assert sum(sizes[:-32]) == 4375 and max(sizes[:-32]) == 80


def test_small_jobs_and_untapered_jobs_use_equal_batches() -> None:
    assert batch_sizes(60, 10, taper=True) == [10] * 6
    assert batch_sizes(5000, 80, taper=False) == [80] * 62 + [40]


def test_new_jobs_cut_the_last_thirty_second_into_sixteenth_size_batches() -> None:
    sizes = batch_sizes(5000, 80, taper=TAPER)  # tail 625: 469 in 20s, then 156 in 5s
    assert sizes[-32:] == [5] * 31 + [1]
    assert sizes[-56:-32] == [20] * 23 + [9]
    assert sum(sizes) == 5000 and sizes[:54] == [80] * 54


def test_a_job_keeps_the_plan_it_was_enqueued_with() -> None:
    manifest = JobManifest(name="j", output="/tmp/o", input=InputInfo("in.jsonl", "0" * 64, 5000, 1),
                           prompts=5000, batch_size=80, batches=89, queue="fleetgen",
                           params=GenerationParams(), taper=1)
    stored = JobManifest.from_json(manifest.to_json())
    assert stored.taper == 1
    assert batch_sizes(5000, 80, taper=stored.taper) == batch_sizes(5000, 80, taper=1)
    assert batch_sizes(5000, 80, taper=1) != batch_sizes(5000, 80, taper=TAPER)
