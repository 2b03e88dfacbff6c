"""Batch boundaries: a pure function of the job, tapered at the end."""

from __future__ import annotations

import pytest

from workers.job import batch_sizes


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
