"""A training script that does nothing special exits 0 on every rank, every time."""

import pytest

from tests.helpers.launch import launch

pytestmark = pytest.mark.slow

RUNS = 20


@pytest.mark.timeout(1200)  # 20 launches; each has its own 120 s limit
def test_twenty_consecutive_launches_exit_cleanly():
    failures = []
    for run in range(RUNS):  # every other run with tensor parallelism: mesh (2, 1, 2)
        result = launch("tests.scenarios.core:train_and_exit", {"tensor_parallel_size": 1 + run % 2}, timeout=120)
        if result.timed_out or result.returncodes != [0, 0, 0, 0]:
            failures.append((run, result.returncodes, [r.stderr[-500:] for r in result.ranks if r.returncode]))
        assert [value["rank"] for value in result.values] == [0, 1, 2, 3]
    assert not failures, failures
