"""``fabric-hsdp plan``: arguments, table, JSON, config files and errors."""

import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from fabric_hsdp.cli import main

EXAMPLES = Path(__file__).resolve().parents[2] / "examples" / "plan"
SEVEN_B = ["plan", str(EXAMPLES / "llama-2-7b.json"), "--num_nodes", "2", "--devices_per_node", "8"]


def run(capsys, *args):
    code = main([str(arg) for arg in args])
    out, err = capsys.readouterr()
    return code, out, err


def test_help_lists_the_options(capsys):
    with pytest.raises(SystemExit) as caught:
        main(["plan", "--help"])
    assert caught.value.code == 0
    out = capsys.readouterr().out
    for option in ("--num_nodes", "--devices_per_node", "--device_memory", "--inter_node_bandwidth", "--precision",
                   "--optimizer", "--micro_batch_size", "--seq_len", "--activation_checkpointing", "--cpu_offload",
                   "--json", "--config"):  # fmt: skip
        assert option in out


def test_json_has_one_entry_per_layout_and_one_recommendation(capsys):
    code, out, err = run(capsys, *SEVEN_B, "--seq_len", "4096", "--json")
    assert code == 0, err
    document = json.loads(out)
    layouts = document["layouts"]
    assert [(entry["shard_size"], entry["tensor_parallel_size"]) for entry in layouts] == [
        (1, 1), (2, 1), (2, 2), (4, 1), (4, 2), (4, 4), (8, 1), (8, 2), (8, 4), (8, 8), (16, 1), (16, 2), (16, 4),
        (16, 8),
    ]  # fmt: skip
    for entry in layouts:
        assert isinstance(entry["shard_size"], int) and isinstance(entry["fits"], bool)
        assert set(entry["bytes_per_device"]) >= {"parameters", "gradients", "optimizer", "total"}
        assert entry["fits"] == (entry["total_with_headroom"] <= document["cluster"]["usable_memory"])
        assert entry["total_with_headroom"] >= entry["bytes_per_device"]["total"]
        shape = [16 // entry["shard_size"], entry["shard_size"]]
        if entry["tensor_parallel_size"] > 1:
            shape = [shape[0], entry["shard_size"] // entry["tensor_parallel_size"], entry["tensor_parallel_size"]]
        assert entry["mesh_shape"] == shape
        assert entry["inter_node_bytes_per_step"] >= 0
    recommended = [entry for entry in layouts if entry["recommended"]]
    assert len(recommended) == 1 and recommended[0] == document["recommended"]
    assert (recommended[0]["shard_size"], recommended[0]["tensor_parallel_size"]) == (8, 1)
    assert document["error"] is None


def test_table_marks_the_recommended_row_and_says_why(capsys, tmp_path):
    config = tmp_path / "plan.yaml"
    config.write_text(f"model: {EXAMPLES / 'llama-2-7b.json'}\nnum_nodes: 2\ndevices_per_node: 8\n")
    code, out, err = run(capsys, "plan", "--config", config, "--tensor_parallel_size", "1",
                         "--inter_node_bandwidth", "400Gbit/s")  # fmt: skip
    assert code == 0, err
    lines = out.splitlines()
    marked = [line for line in lines if line.startswith("->")]
    assert len(marked) == 1 and marked[0].split()[1:6] == ["8", "1", "1", "1", "2x8"]
    assert "50.0 GB/s between nodes (per node)" in out and "inter-node time" in out
    winner = "recommended: shard_size=8 (one node), mesh (2, 8), micro-batch 1 x 1 accumulation step, activation"
    assert any(line.startswith(winner) for line in lines)
    assert "activations are an estimate" in out


def test_nothing_fits_prints_the_table_then_one_error_line(capsys):
    code, out, err = run(capsys, "plan", EXAMPLES / "llama-65b.json", "--num_nodes", "2", "--devices_per_node", "8",
                         "--seq_len", "4096", "--tensor_parallel_size", "1")  # fmt: skip
    assert code == 2
    assert "recommended: none" in out
    assert err.startswith("fabric-hsdp: error: no layout fits 72.0 GB per device") and err.count("\n") == 1
    # the plan weighs recompute itself: CPU offload alone fits, with the recompute it chose
    assert "; CPU offload (shard_size=8 (one node), mesh (2, 8), micro-batch 1 x 1 accumulation step, activation" in err


def test_unknown_model_source(capsys):
    code, _, err = run(capsys, "plan", "not-a-model-name")
    assert code == 2
    assert "cannot read model source 'not-a-model-name': tried a file or directory" in err


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--precision", "fp8"], "(see fabric-hsdp --help)"),
        (["--device_memory", "lots"], "device_memory='lots' is not a size"),
        (["--inter_node_bandwidth", "fast"], "inter_node_bandwidth='fast' is not a rate"),
        (["--micro_batch_size", "0"], "micro_batch_size=0 must be a positive integer"),
    ],
)
def test_bad_arguments_say_what_is_wrong(capsys, args, message):
    code, _, err = run(capsys, *SEVEN_B, *args)
    assert code == 2 and message in err


def test_plan_imports_neither_lightning_nor_the_strategy():
    code = (
        "import json, sys; from fabric_hsdp.cli import main;"
        f" code = main(['plan', {str(EXAMPLES / 'llama-2-7b.json')!r}, '--json']);"
        " print(json.dumps([code, sorted(sys.modules)]), file=sys.stderr)"
    )
    env = dict(os.environ, PYTHONPATH=str(EXAMPLES.parents[1]))
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env)
    code, modules = json.loads(result.stderr.splitlines()[-1])
    assert code == 0
    assert [name for name in modules if name == "lightning" or name.startswith("lightning.")] == []
    assert "fabric_hsdp.strategy" not in modules and "fabric_hsdp.planning.plan" in modules


def test_worked_examples_in_the_docs_are_the_tools_output(capsys, monkeypatch):
    repository = EXAMPLES.parents[1]
    monkeypatch.chdir(repository)
    text = (repository / "docs" / "concepts.md").read_text()
    blocks = re.findall(r"```\n\$ fabric-hsdp (plan [^\n]*)\n(.*?)\n```", text, re.S)
    assert len(blocks) == 7
    for command, shown in blocks:
        _, out, err = run(capsys, *shlex.split(command))
        assert (out + err).rstrip("\n") == shown, command
