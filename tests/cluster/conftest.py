"""The session's SLURM cluster (tests/helpers/slurm_cluster.py): started once, for the tests that ask for it."""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest

from tests.helpers.slurm_cluster import SlurmCluster, missing_requirements


@pytest.fixture(scope="session")
def slurm_cluster(request: pytest.FixtureRequest) -> Iterator[SlurmCluster]:
    """A running two-node cluster; its directory (logs included) is kept if a test failed while it ran.

    Where the machine lacks what the cluster needs, the tests fail in CI (``CI`` set: ``.ci/run`` installs it all, so
    something is broken) and are skipped elsewhere, with the reason and the command that installs it.
    """
    problems = missing_requirements()
    if problems:
        message = "SLURM test cluster unavailable: " + "; ".join(problems)
        if os.environ.get("CI", "").lower() in ("1", "true", "yes"):
            pytest.fail(message, pytrace=False)
        pytest.skip(message)
    cluster = SlurmCluster()
    failures_before = request.session.testsfailed
    cluster.start()
    yield cluster
    keep = request.session.testsfailed > failures_before
    cluster.stop(keep_directory=keep)
    if keep:
        print(f"\nSLURM test cluster: logs kept in {cluster.directory}")
