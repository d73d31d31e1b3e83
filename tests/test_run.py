"""``fabric-hsdp run``: Lightning's ``fabric run`` with ``--strategy hsdp`` that works (fabric_hsdp/run.py)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from fabric_hsdp.cli import main
from tests.helpers.launch import free_port

# A user's script that knows nothing of fabric_hsdp: Fabric() takes accelerator, devices and strategy from the command.
PLAIN_FABRIC_SCRIPT = """
import json
import sys
from pathlib import Path

import lightning as L
import torch


class Model(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = torch.nn.ModuleList(torch.nn.Linear(8, 8) for _ in range(2))

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return x


fabric = L.Fabric()
model = fabric.setup_module(Model())
optimizer = fabric.setup_optimizers(torch.optim.SGD(model.parameters(), lr=0.1))
fabric.backward(model(torch.ones(4, 8)).sum())
optimizer.step()
report = {
    "strategy": type(fabric.strategy).__name__,
    "mesh": list(fabric.strategy.device_mesh.shape),
    "world_size": fabric.world_size,
    "argv": sys.argv,
    "name": __name__,
    "path0": sys.path[0],
}
Path(sys.argv[1], f"rank{fabric.global_rank}.json").write_text(json.dumps(report))
"""


def test_run_offers_hsdp_and_rejects_unknown_strategies_like_fabric_run(capsys):
    assert main(["run", "--help"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("Usage: fabric-hsdp run [OPTIONS] SCRIPT [SCRIPT_ARGS]...")
    assert "|fsdp|hsdp]" in out
    assert main(["run", "--strategy", "hdsp", "--accelerator", "cpu", __file__]) == 2
    assert "Invalid value for '--strategy': 'hdsp' is not one of" in capsys.readouterr().err


@pytest.mark.slow
def test_run_strategy_hsdp_trains_a_script_that_never_imports_fabric_hsdp(tmp_path):
    script = tmp_path / "plain.py"
    script.write_text(PLAIN_FABRIC_SCRIPT)
    command = [str(Path(sys.executable).with_name("fabric-hsdp")), "run", "--accelerator", "cpu", "--devices", "2"]
    command += ["--strategy", "hsdp", "--main-port", str(free_port()), str(script), str(tmp_path), "--flag", "x"]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    result = subprocess.run(command, env=env, cwd=tmp_path, capture_output=True, text=True, timeout=240)
    assert result.returncode == 0, f"{result.stdout[-3000:]}\n{result.stderr[-6000:]}"
    reports = [json.loads((tmp_path / f"rank{rank}.json").read_text()) for rank in (0, 1)]
    for report in reports:
        assert (report["strategy"], report["mesh"], report["world_size"]) == ("HybridFSDPStrategy", [1, 2], 2)
        # run as `python plain.py ARGS` would be: as __main__, its own argv, its directory first on sys.path
        assert (report["name"], report["argv"]) == ("__main__", [str(script), str(tmp_path), "--flag", "x"])
        assert report["path0"] == str(tmp_path)
