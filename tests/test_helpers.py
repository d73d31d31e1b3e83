"""The test launcher's own rules (no processes are launched here)."""

import time

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
