"""``python -m fabric_hsdp``: the same as the ``fabric-hsdp`` command."""

import sys

from fabric_hsdp.cli import main

if __name__ == "__main__":
    sys.exit(main())
