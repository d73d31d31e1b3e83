"""One rank of a launched test: import the scenario, run it, save what it returns (see ``launch.py``).

A rank whose scenario returned ends the way the interpreter's exit begins -- non-daemon threads joined (a background
save's writer), ``atexit`` handlers run (the strategy's exit handler, which may set the status), output flushed --
and then ``os._exit``, skipping the teardown of every module: in a rank forked from the fork server that teardown
touches every inherited object (copy-on-write) and took 1.5-2.5 s a launch on 2 busy cores, for nothing a test reads.
``FABRIC_HSDP_TEST_INTERPRETER_EXIT=1`` (``launch(..., interpreter_exit=True)``) keeps the whole teardown, for the
tests of how a rank exits. A scenario that raises (or calls ``sys.exit``) always takes the interpreter's whole exit.
"""

import atexit
import importlib
import json
import os
import sys
import threading

import torch


def main() -> None:
    scenario, raw_args, out_file = sys.argv[1], sys.argv[2], sys.argv[3]
    module_name, function_name = scenario.split(":")
    function = getattr(importlib.import_module(module_name), function_name)
    value = function(**json.loads(raw_args))
    torch.save(value, out_file)


def exit_without_teardown() -> None:
    """What the interpreter does at exit before it tears the modules down, then ``os._exit(0)``."""
    threading._shutdown()  # joins non-daemon threads, as the interpreter's exit does first
    atexit._run_exitfuncs()  # a handler may end the process (the strategy's, status 1)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
    if os.environ.get("FABRIC_HSDP_TEST_INTERPRETER_EXIT") != "1":
        exit_without_teardown()
