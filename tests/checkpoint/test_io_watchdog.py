"""The checkpoint I/O watchdog: a rank stalled in a read or a write fails every rank with where it stopped."""

import re
import time

import pytest

from tests.helpers.launch import launch

pytestmark = pytest.mark.slow


@pytest.mark.parametrize(
    ("stall", "stalled_rank", "what", "file"),
    [
        ("load-fifo", 2, "reading", ".distcp'"),
        ("save-stop", 1, "writing", ".distcp'"),
        ("full-save-fifo", 0, "writing", "/full.pth'"),  # one file from rank 0, the others in its gathers
    ],
)
def test_stalled_rank_fails_every_rank_with_its_file_and_progress(tmp_path, stall, stalled_rank, what, file):
    io_timeout = 2.0
    result = launch(
        "tests.scenarios.io:stalled_io",
        {"out": str(tmp_path), "stalled_rank": stalled_rank, "stall": stall, "io_timeout": io_timeout},
        timeout=150,
        fail_grace=5,
        env={"FABRIC_HSDP_DEBUG": "1"},  # each rank's own error line, not rank 0's one line for the job
    )
    assert not result.timed_out, [rank.stderr[-2000:] for rank in result.ranks]
    waiting = [rank for rank in result.ranks if rank.global_rank != stalled_rank]
    # a stopped rank is killed by the launcher; a blocked one ends itself
    assert all(rank.returncode == 1 for rank in waiting), result.returncodes
    assert all(rank.value is None for rank in result.ranks)  # nobody finished the stalled operation
    for rank in waiting if stall == "save-stop" else result.ranks:
        line = next((line for line in rank.stderr.splitlines() if "checkpoint I/O stalled" in line), None)
        assert line is not None, rank.stderr[-3000:]
        assert f"rank {stalled_rank} (host " in line and f"for {io_timeout:g} s {what} '" in line, line
        assert file in line and " bytes done in this operation" in line, line
        done = int(re.search(r"\(([\d,]+) bytes done", line).group(1).replace(",", ""))
        assert done > 0, line
    # how far it got: the read or write before the stall counted
    # failed a few io_timeouts after the stall (and the launcher's 5 s grace for a stopped rank), not after the
    # collectives' 5-minute timeout
    assert time.time() - float((tmp_path / "stalled_at").read_text()) < 60


def test_a_stopped_store_host_fails_the_other_ranks_naming_the_store(tmp_path):
    """Rank 0 serves the job's store: stopped mid-save, nobody can post or read a stall there, and a store call to
    a stopped server outwaits its own timeout; the other ranks' watchdogs time their store calls and end."""
    io_timeout = 2.0
    result = launch(
        "tests.scenarios.io:stalled_io",
        {"out": str(tmp_path), "stalled_rank": 0, "stall": "save-stop", "io_timeout": io_timeout},
        timeout=150,
        fail_grace=5,
        env={"FABRIC_HSDP_DEBUG": "1"},  # each rank's own error line, not rank 0's one line for the job
    )
    assert not result.timed_out, [rank.stderr[-2000:] for rank in result.ranks]
    waiting = [rank for rank in result.ranks if rank.global_rank != 0]
    assert [rank.returncode for rank in waiting] == [1, 1, 1], result.returncodes
    for rank in waiting:
        line = next((line for line in rank.stderr.splitlines() if "the job's store (" in line), None)
        assert line is not None, rank.stderr[-3000:]
        assert f"has not answered rank {rank.global_rank} (host " in line and f"for {io_timeout:g} s" in line, line
    assert time.time() - float((tmp_path / "stalled_at").read_text()) < 60
