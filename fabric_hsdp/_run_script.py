"""What ``fabric-hsdp run`` starts in every process: ``python _run_script.py SCRIPT [ARGS...]``.

Imports ``fabric_hsdp`` (registering ``strategy="hsdp"``, so that ``Fabric()`` resolves ``LT_STRATEGY=hsdp``), then
runs SCRIPT as ``__main__`` the way ``python SCRIPT ARGS`` would: ``sys.argv = [SCRIPT, *ARGS]`` and SCRIPT's directory
first on ``sys.path`` (in place of this file's).
"""

import os
import runpy
import sys


def main() -> None:
    if len(sys.argv) < 2:
        raise SystemExit("usage: python _run_script.py SCRIPT [ARGS...]  (started by `fabric-hsdp run`)")
    script = sys.argv[1]
    sys.argv = sys.argv[1:]
    sys.path[0] = os.path.dirname(os.path.abspath(script))

    import fabric_hsdp  # noqa: F401

    runpy.run_path(script, run_name="__main__")


if __name__ == "__main__":
    main()
