"""``fabric-hsdp run``: Lightning's ``fabric run`` with ``--strategy hsdp`` that works (fabric_hsdp/run.py)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from fabric_hsdp.cli import main
from tests.helpers.launch import REPO_ROOT, free_port

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


@pytest.mark.timeout(120)
def test_a_node_waiting_for_the_others_in_torchruns_rendezvous_says_so(tmp_path):
    """#34: node 0 of a 2-node `fabric-hsdp run` whose other node never starts was silent for torchrun's 600 s."""
    import re
    import select
    import signal
    import time

    script = tmp_path / "never_runs.py"
    script.write_text("raise SystemExit('the nodes never met, so this never runs')\n")
    port = free_port()
    code = (
        "import sys; from fabric_hsdp.processes import distributed; distributed.RENDEZVOUS_NOTICE = 2.0;"
        " from fabric_hsdp.cli import main; sys.exit(main(sys.argv[1:]))"
    )
    command = [sys.executable, "-c", code, "run", "--accelerator", "cpu", "--devices", "1", "--num-nodes", "2"]
    command += ["--node-rank", "0", "--main-address", "127.0.0.1", "--main-port", str(port), str(script)]
    env = dict(os.environ, PYTHONWARNINGS="ignore")
    process = subprocess.Popen(command, env=env, stderr=subprocess.PIPE, text=True, start_new_session=True)
    said, deadline = [], time.monotonic() + 90
    try:
        while not said and time.monotonic() < deadline and process.poll() is None:
            if select.select([process.stderr], [], [], 1.0)[0]:
                line = process.stderr.readline()
                said += [line.strip()] if "has waited since" in line else []
    finally:
        os.killpg(process.pid, signal.SIGKILL)
        process.wait()
    assert len(said) == 1, said
    assert re.fullmatch(
        rf"fabric-hsdp run: node 0 has waited since \d\d:\d\d:\d\d UTC for all 2 nodes of the job to join torchrun's"
        rf" rendezvous at 127\.0\.0\.1:{port} \(--main-address and --main-port\); a node whose launch did not start"
        rf" keeps the others waiting until \d\d:\d\d:\d\d UTC \(torchrun's timeout, 0:10:00\)\. Start `fabric-hsdp"
        rf" run` on every node with the same --num-nodes, --main-address and --main-port\.",
        said[0],
    ), said[0]


FAILING_SCRIPT = """
import lightning as L
import torch

fabric = L.Fabric()
model = fabric.setup_module(torch.nn.Linear(4, 4))  # no layers to shard: the package's one-line error
"""


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_every_node_of_a_failed_job_ends_its_log_with_the_reason_in_one_line(tmp_path):
    """#44: node 0 printed the reason; node 1's shell showed torchrun's summary (a link to torch's docs in place of the
    reason) and never the reason. Two `fabric-hsdp run` launches, --node-rank 0 and 1, as on two machines."""
    path = tmp_path / "train.py"
    path.write_text(FAILING_SCRIPT)
    port = free_port()
    launches = []
    for node_rank in (0, 1):
        command = [str(Path(sys.executable).with_name("fabric-hsdp")), "run", "--accelerator", "cpu", "--devices", "2"]
        command += ["--num-nodes", "2", "--node-rank", str(node_rank), "--main-address", "127.0.0.1"]
        command += ["--main-port", str(port), "--strategy", "hsdp", str(path)]
        # this checkout's package in the launcher and its workers, whatever the venv's editable install points at
        env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore", PYTHONPATH=str(REPO_ROOT))
        launches.append(subprocess.Popen(command, env=env, cwd=tmp_path, stderr=subprocess.PIPE, text=True))
    logs = [process.communicate(timeout=200)[1] for process in launches]
    for node_rank, (process, log) in enumerate(zip(launches, logs)):
        assert process.returncode == 1, log
        assert re.fullmatch(
            r"fabric-hsdp run: rank \d \(local rank \d\) failed: fabric-hsdp: error: HybridFSDPStrategy\("
            r"sharded_modules=None .* matched no submodule of Linear, .* \(set FABRIC_HSDP_DEBUG=1 for the"
            r" traceback\)",
            log.strip().splitlines()[-1],
        ), (node_rank, log)
        assert "To enable traceback see" not in log, log


def test_a_failed_rank_without_the_packages_reason_is_named_with_where_its_traceback_is(tmp_path):
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure

    from fabric_hsdp.run import failure_line

    no_file = ChildFailedError("train.py", {3: ProcessFailure(1, 1234, 1, str(tmp_path / "none.json"))})
    assert failure_line(no_file) == (
        "fabric-hsdp run: rank 3 (local rank 1) exited with code 1; its traceback is in this node's log above"
    )
    killed = ChildFailedError("train.py", {2: ProcessFailure(0, 1234, -9, str(tmp_path / "none.json"))})
    assert failure_line(killed) == (
        "fabric-hsdp run: rank 2 (local rank 0) was killed by SIGKILL (out of memory is a common cause)"
    )
