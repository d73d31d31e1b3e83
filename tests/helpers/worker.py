"""One rank of a launched test: import the scenario, run it, save what it returns (see ``launch.py``)."""

import importlib
import json
import sys

import torch


def main() -> None:
    scenario, raw_args, out_file = sys.argv[1], sys.argv[2], sys.argv[3]
    module_name, function_name = scenario.split(":")
    function = getattr(importlib.import_module(module_name), function_name)
    value = function(**json.loads(raw_args))
    torch.save(value, out_file)


if __name__ == "__main__":
    main()
