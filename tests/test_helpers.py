"""The test launcher's own rules and the suite's (the suite's rules are run in a small pytest of their own)."""

import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.helpers import launch


def test_a_launch_ends_before_the_pytest_timeout_of_its_test(monkeypatch):
    # 300 s test, 100 s of it already spent (e.g. by a fixture's launch): a 250 s launch gets what is left
    monkeypatch.setattr(launch, "test_budget", (300.0, time.monotonic() + 200.0))
    assert 200.0 - launch.MARGIN - 1 < launch._budget(250.0) <= 200.0 - launch.MARGIN
    assert launch._budget(60.0) == 60.0
    # a launch that asks for more than the whole test may take is an error in the test, said with the fix
    with pytest.raises(ValueError, match=r"launch\(timeout=400\) is more than .* \(300 s\) .*timeout\(416\)"):
        launch._budget(400.0)
    monkeypatch.setattr(launch, "test_budget", None)  # outside pytest: as asked
    assert launch._budget(400.0) == 400.0


@pytest.mark.timeout(123)
def test_the_budget_is_the_tests_own_timeout():
    seconds, deadline = launch.test_budget
    assert seconds == 123.0 and 0 < deadline - time.monotonic() <= 123.0


def _pytest_with_the_suites_rules(directory: Path, *args: str, **env: str) -> subprocess.CompletedProcess:
    """pytest on ``directory`` with this suite's conftest as a plugin (its skip and timeout rules)."""
    environment = {**os.environ, "PYTHONPATH": str(launch.REPO_ROOT), "CI": "", "FABRIC_HSDP_NO_SKIPS": "", **env}
    command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "tests.conftest", *args]
    return subprocess.run(command, cwd=directory, env=environment, capture_output=True, text=True, timeout=120)


def test_a_module_that_skips_itself_at_collection_fails_under_make_test(tmp_path):
    """#46 item 5: ``pytest.skip(allow_module_level=True)`` (or ``importorskip``) is a collection skip, which the
    runtest rule never sees: under ``make test`` / CI it must fail, naming the module; elsewhere it stays a skip."""
    (tmp_path / "test_tool.py").write_text(
        "import pytest\n\npytest.skip('the tool is missing', allow_module_level=True)\n\n\ndef test_x():\n    pass\n"
    )
    strict = _pytest_with_the_suites_rules(tmp_path, "test_tool.py", FABRIC_HSDP_NO_SKIPS="1")
    assert strict.returncode == 2, strict.stdout  # 2: a collection error
    assert "test_tool.py skipped at collection under CI / make test" in strict.stdout, strict.stdout
    assert "the tool is missing" in strict.stdout, strict.stdout
    relaxed = _pytest_with_the_suites_rules(tmp_path, "test_tool.py")
    assert relaxed.returncode == 5 and "1 skipped" in relaxed.stdout, relaxed.stdout  # 5: no test ran, none failed


def test_a_hung_test_is_ended_with_its_name_when_the_sessions_time_is_up(tmp_path):
    """#46 item 5: pytest-timeout's ``--session-timeout`` is checked only between tests, so one hung test would hold
    the run for its own timeout (up to 2,000 s here) past CI's limit. The suite cuts each test's timeout to what the
    session has left: the hang ends when the session's time is up, named, and the session stops."""
    (tmp_path / "test_hang.py").write_text(
        "import time\n\nimport pytest\n\n\n"
        "@pytest.mark.timeout(600)\ndef test_hangs():\n    time.sleep(60)\n\n\n"
        "def test_after():\n    pass\n"
    )
    started = time.monotonic()
    result = _pytest_with_the_suites_rules(tmp_path, "--session-timeout=5", "test_hang.py")
    assert time.monotonic() - started < 40, result.stdout  # not the 60 s of the hang
    assert result.returncode == 1, result.stdout
    assert "FAILED test_hang.py::test_hangs - Failed: Timeout" in result.stdout, result.stdout
    assert "session-timeout: 5.0 sec exceeded" in result.stdout, result.stdout
    assert "1 failed in" in result.stdout and "passed" not in result.stdout, result.stdout  # test_after never ran


def rendezvous_port(num_nodes: int, devices: int) -> int:
    """A rank that joins the job's process group and reports the port it met the others at."""
    from tests.helpers.training import make_fabric

    make_fabric(num_nodes, devices)
    return int(os.environ["MASTER_PORT"])


def test_a_launch_whose_port_another_process_took_starts_again_on_another(monkeypatch):
    """#46 item 5: ``free_port()`` releases the port it found before rank 0 binds it, so another job on the machine
    can take it in between (rank 0 then fails with EADDRINUSE and the others wait for its store). The launch starts
    its ranks again on another port."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as taken:
        taken.bind(("127.0.0.1", 0))  # what another process did right after free_port() answered
        lost = taken.getsockname()[1]
        answers, real = iter([lost]), launch.free_port
        monkeypatch.setattr(launch, "free_port", lambda: next(answers, None) or real())
        result = launch.launch(rendezvous_port, num_nodes=1, ranks_per_node=2, timeout=120)
    ports = result.check().values
    assert ports[0] == ports[1] != lost, (ports, lost)
