"""Suite-wide rules.

Under CI (``CI`` set) and under ``make test`` (the README's command, which sets ``FABRIC_HSDP_NO_SKIPS=1``) a skipped
test is a failure: everything the README promises must have run. Elsewhere (a developer's ``pytest``) a skip stays
a skip, with its reason. A test marked ``@pytest.mark.optional`` (what the README does not promise, e.g. a GPU) may
skip anywhere.

Every launch (``tests/helpers/launch.py``) ends before pytest-timeout would end its test: a launch's budget is cut to
what the test's timeout (which counts fixture set-up) has left, so a slow launch is reported with what each rank
printed, not as pytest-timeout's thread dump; a test whose single launch asks for more than its whole timeout is an
error in the test (raise its ``@pytest.mark.timeout``).
"""

from __future__ import annotations

import time

import pytest

from tests.helpers.strict import skips_are_failures


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo) -> object:
    outcome = yield
    report = outcome.get_result()
    optional = item.get_closest_marker("optional") is not None  # hardware the README does not promise (a GPU)
    if report.skipped and not hasattr(report, "wasxfail") and not optional and skips_are_failures():
        reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr)
        report.outcome = "failed"
        report.longrepr = f"skipped under CI / make test, where every test must run: {reason}"


def _timeout_of(item: pytest.Item) -> float | None:
    marker = item.get_closest_marker("timeout")
    if marker is not None:
        value = marker.args[0] if marker.args else marker.kwargs.get("timeout")
    else:
        value = item.config.getini("timeout")  # pytest-timeout's setting (a test dependency)
    return float(value) if value else None


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None) -> None:
    from tests.helpers import launch

    seconds = _timeout_of(item)
    launch.test_budget = None if seconds is None else (seconds, time.monotonic() + seconds)
