"""One rank of a launched test: import the scenario, run it, save what it returns (see ``launch.py``).

After a scenario that returned, the process ends once every ``atexit`` handler has run (the strategy's exit handler
among them) without the interpreter's finalisation of all modules, which costs seconds per rank and tests nothing
of ours. ``FABRIC_HSDP_TEST_FULL_EXIT=1`` keeps the whole shutdown: the clean-exit test sets it, since an abort at
exit (C++ destructors) happens there. A scenario that raised always exits the normal way, with status 1.
"""

import atexit
import importlib
import json
import logging
import os
import sys

import torch

_returned = False


def _exit_after_the_handlers() -> None:
    # registered first, so it runs last of the handlers registered while the scenario ran
    if _returned and os.environ.get("FABRIC_HSDP_TEST_FULL_EXIT") != "1":
        logging.shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)


def main() -> None:
    global _returned
    atexit.register(_exit_after_the_handlers)
    scenario, raw_args, out_file = sys.argv[1], sys.argv[2], sys.argv[3]
    module_name, function_name = scenario.split(":")
    function = getattr(importlib.import_module(module_name), function_name)
    value = function(**json.loads(raw_args))
    torch.save(value, out_file)
    _returned = True


if __name__ == "__main__":
    main()
