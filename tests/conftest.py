"""Suite-wide rules.

Under CI (``CI`` set) and under ``make test`` (the README's command, which sets ``FABRIC_HSDP_NO_SKIPS=1``) a skipped
test is a failure: everything the README promises must have run. Elsewhere (a developer's ``pytest``) a skip stays
a skip, with its reason. A test marked ``@pytest.mark.optional`` (what the README does not promise, e.g. a GPU) may
skip anywhere.

Every launch (``tests/helpers/launch.py``) ends before pytest-timeout would end its test: a launch's budget is cut to
what the test's timeout (which counts fixture set-up) has left, so a slow launch is reported with what each rank
printed, not as pytest-timeout's thread dump; a test whose single launch asks for more than its whole timeout is an
error in the test (raise its ``@pytest.mark.timeout``).

With pytest-timeout's ``--session-timeout`` (``make test`` and ``make test-core`` set one, under CI's limit) each
test's timeout is cut to what the session has left, so a hung test is ended, with its name and stacks, when the
session's time is up (pytest-timeout alone checks the session only between tests); the session then stops.
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


@pytest.hookimpl(hookwrapper=True)
def pytest_make_collect_report(collector: pytest.Collector) -> object:
    """A module that skips itself while being collected (``pytest.skip(allow_module_level=True)``,
    ``pytest.importorskip``) fails too where skips are failures: otherwise all its tests would pass unseen."""
    outcome = yield
    report = outcome.get_result()
    if report.skipped and skips_are_failures():
        reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr)
        report.outcome = "failed"
        report.longrepr = (
            f"{collector.nodeid} skipped at collection under CI / make test, where every test must run: {reason}"
        )


def _timeout_of(item: pytest.Item) -> float | None:
    marker = item.get_closest_marker("timeout")
    if marker is not None:
        value = marker.args[0] if marker.args else marker.kwargs.get("timeout")
    else:
        value = item.config.getini("timeout")  # pytest-timeout's setting (a test dependency)
    return float(value) if value else None


_session_deadline: float | None = None  # time.monotonic() when --session-timeout runs out


def pytest_configure(config: pytest.Config) -> None:
    global _session_deadline
    seconds = config.getoption("session_timeout", None) or config.getini("session_timeout")  # pytest-timeout's
    _session_deadline = time.monotonic() + float(seconds) if seconds else None


@pytest.hookimpl(hookwrapper=True, tryfirst=True)  # around pytest-timeout's wrapper, which reads the marker first
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None) -> object:
    from tests.helpers import launch

    seconds = _timeout_of(item)
    deadline = None if seconds is None else time.monotonic() + seconds
    if _session_deadline is not None and (deadline is None or _session_deadline < deadline):
        left = max(1.0, _session_deadline - time.monotonic())
        item.add_marker(pytest.mark.timeout(left), append=False)  # the closest marker: pytest-timeout's setting
        deadline = time.monotonic() + left
    launch.test_budget = None if seconds is None else (seconds, deadline)
    yield
