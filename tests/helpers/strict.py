"""Whether this run must run everything: under CI (``CI`` set) or ``make test`` (``FABRIC_HSDP_NO_SKIPS=1``)."""

import os


def skips_are_failures() -> bool:
    return any(os.environ.get(name, "").lower() in ("1", "true", "yes") for name in ("CI", "FABRIC_HSDP_NO_SKIPS"))
