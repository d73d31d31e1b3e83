"""The session's SLURM cluster (tests/helpers/slurm_cluster.py): started once, for the tests that ask for it."""

from __future__ import annotations

import shutil
from collections.abc import Iterator

import pytest

from tests.helpers.slurm_cluster import SlurmCluster, missing_requirements
from tests.helpers.strict import skips_are_failures


@pytest.fixture(scope="session")
def slurm_cluster(request: pytest.FixtureRequest) -> Iterator[SlurmCluster]:
    """A running two-node cluster; its directory (logs included) is kept if a test failed while it ran.

    Where the machine lacks what the cluster needs, the tests fail in CI and under ``make test`` (``.ci/run`` installs
    it all, so something is broken) and wherever SLURM is installed (a half-installed cluster must not pass as
    "skipped"); they are skipped only on a machine without SLURM, with the reason and the command that installs it.
    """
    problems = missing_requirements()
    if problems:
        message = "SLURM test cluster unavailable: " + "; ".join(problems)
        if skips_are_failures() or shutil.which("sbatch") or shutil.which("slurmctld"):
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
