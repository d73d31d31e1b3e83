"""The examples users copy: train.py, finetune.py and the main job (examples/main_job.py), run as users run them."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from tests.helpers.launch import REPO_ROOT, launch
from tests.helpers.training import finetune

sys.path.insert(0, str(REPO_ROOT))
from examples.finetune import detect_format, export_model, layout_line, load_tokenizer, read_documents  # noqa: E402
from examples.launching import devices_and_nodes, latest_checkpoint  # noqa: E402

TRAIN = REPO_ROOT / "examples" / "train.py"


def test_latest_checkpoint_takes_the_highest_step_and_ignores_other_names(tmp_path):
    assert latest_checkpoint(tmp_path / "missing") is None
    assert latest_checkpoint(tmp_path) is None
    for name in ("step-000002", "step-000010", "step-9", ".step-000011.staging", "step-000012.tmp", "notes"):
        (tmp_path / name).mkdir()
    assert latest_checkpoint(tmp_path) == tmp_path / "step-000010"


def test_devices_and_nodes_follow_the_launcher(monkeypatch):
    """torchrun, srun and mpirun (inside the allocation) as they set their variables (fabric_hsdp.processes.launchers
    decides)."""
    launcher_variables = ("TORCHELASTIC_RUN_ID", "LOCAL_WORLD_SIZE", "WORLD_SIZE", "OMPI_COMM_WORLD_SIZE")
    for name in list(os.environ):
        if name == "LT_CLI_USED" or name.startswith("SLURM_") or name in launcher_variables:
            monkeypatch.delenv(name)
    assert devices_and_nodes("auto", None) == ("auto", 1)
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "run42")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    monkeypatch.setenv("WORLD_SIZE", "16")
    assert devices_and_nodes("auto", None) == (4, 4)
    assert devices_and_nodes(2, 8) == (2, 8)  # explicit values win
    monkeypatch.delenv("TORCHELASTIC_RUN_ID")
    for name, value in dict(SLURM_NTASKS="16", SLURM_NNODES="2", SLURM_PROCID="3", SLURM_STEP_ID="0").items():
        monkeypatch.setenv(name, value)
    monkeypatch.setenv("SLURM_STEP_TASKS_PER_NODE", "8(x2)")
    monkeypatch.setenv("SLURM_STEP_NUM_NODES", "2")
    assert devices_and_nodes("auto", None) == (8, 2)
    monkeypatch.setenv("OMPI_COMM_WORLD_SIZE", "12")  # mpirun inside the allocation: its numbers, not SLURM's
    monkeypatch.setenv("OMPI_COMM_WORLD_LOCAL_SIZE", "4")
    assert devices_and_nodes("auto", None) == (4, 3)
    monkeypatch.setenv("LT_CLI_USED", "1")  # under `fabric run` the CLI's --devices/--num-nodes apply
    assert devices_and_nodes("auto", None) == ("auto", 1)


def _run(command: list[str], timeout: float = 240) -> str:
    env = dict(os.environ, PYTHONWARNINGS="ignore", OMP_NUM_THREADS="1")
    result = subprocess.run(command, cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    assert result.returncode == 0, (
        f"{' '.join(command)} exited {result.returncode}:\n{result.stdout[-3000:]}\n" + (result.stderr[-6000:])
    )
    return result.stdout + result.stderr


def _torchrun(out_dir: Path, *args: str) -> str:
    # --standalone: torchrun's own store binds a port the OS picks and holds it (a port from free_port() could be
    # taken by another job before torchrun binds it)
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
    return _run([*command, str(TRAIN), "--out_dir", str(out_dir), *args])


def _loss_at(step: int, output: str) -> str:
    found = re.findall(rf"step {step}/\d+: train loss ([0-9.]+)", output)
    assert found, output[-3000:]
    return found[-1]


def _tensors(tree, prefix=""):
    """The tensors of a nested dict/list, by dotted path."""
    if isinstance(tree, torch.Tensor):
        return {prefix: tree}
    items = tree.items() if isinstance(tree, dict) else enumerate(tree) if isinstance(tree, list | tuple) else []
    found = {}
    for key, value in items:
        found.update(_tensors(value, f"{prefix}.{key}" if prefix else str(key)))
    return found


@pytest.mark.slow
@pytest.mark.timeout(3 * 240 + 40)  # three torchrun jobs of 240 s at most
def test_train_resumes_from_its_sharded_checkpoint_exactly(tmp_path):
    """Stopped at step 4 and started again, training reaches the same loss at step 8 as without the stop.

    The stopped run saves in the background (``--async_save``) and ends right after: the checkpoint must be whole.
    """
    args = ["--log_every", "4", "--batch_size", "4"]
    straight = _torchrun(tmp_path / "straight", "--max_steps", "8", "--save_every", "0", *args)
    stopped = _torchrun(tmp_path / "stopped", "--max_steps", "4", "--save_every", "0", "--async_save", "true", *args)
    assert "saving" in stopped and "in the background" in stopped
    resumed = _torchrun(tmp_path / "stopped", "--max_steps", "8", "--save_every", "0", *args)
    assert "resumed from" in resumed and "step-000004 (step 4)" in resumed
    assert _loss_at(8, resumed) == _loss_at(8, straight)
    assert sorted(p.name for p in (tmp_path / "stopped").iterdir()) == ["step-000004", "step-000008"]
    # exact, not to the 4 printed decimals: every weight and optimizer moment of step 8 is bit-equal
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    final = {}
    for run in ("straight", "stopped"):
        dcp_to_torch_save(tmp_path / run / "step-000008", tmp_path / f"{run}.pt")
        final[run] = torch.load(tmp_path / f"{run}.pt", weights_only=False)
    straight_tensors, resumed_tensors = (
        _tensors({"model": c["model"], "optimizer": c["optimizer"]}) for c in final.values()
    )
    assert any(k.startswith("optimizer.state.") for k in straight_tensors), sorted(straight_tensors)[:5]
    assert resumed_tensors.keys() == straight_tensors.keys()
    assert [k for k, v in straight_tensors.items() if not torch.equal(resumed_tensors[k], v)] == []


def test_finetune_start_up_line_names_every_mesh_dim():
    from fabric_hsdp.topology import Topology

    # it printed "mesh (replicate, shard) = (2, 1, 2)" under tensor parallelism, as train.py (no TP) still does
    assert layout_line(Topology.resolve("node", 2, 2, 4, tensor_parallel_size=2)) == (
        "4 ranks = 2 node(s) x 2, mesh (replicate, shard, tensor) = (2, 1, 2)"
    )
    assert (
        layout_line(Topology.resolve("world", 2, 2, 4)) == "4 ranks = 2 node(s) x 2, mesh (replicate, shard) = (1, 4)"
    )


def test_finetune_tells_a_directory_that_is_no_checkpoint_and_falls_back_to_labelled_bytes(tmp_path):
    (tmp_path / "notes.txt").write_text("hi")
    with pytest.raises(FileNotFoundError, match=r"neither a litgpt checkpoint .* it holds \['notes.txt'\]"):
        detect_format(tmp_path)
    (tmp_path / "config.json").write_text("{}")
    (tmp_path / "model.safetensors").write_bytes(b"")
    assert detect_format(tmp_path) == "transformers"
    (tmp_path / "lit_model.pth").write_bytes(b"")
    (tmp_path / "model_config.yaml").write_text("")
    assert detect_format(tmp_path) == "litgpt"  # a litgpt download also holds config.json
    tokenizer = load_tokenizer("litgpt", tmp_path, model_vocab_size=300)  # no tokenizer files
    assert tokenizer.kind == "bytes" and "FALLBACK" in tokenizer.describe()
    assert tokenizer.encode("hé") == [104, 195, 169] and tokenizer.decode([104, 195, 169]) == "hé"


def test_finetune_reads_jsonl_records_and_names_a_bad_line(tmp_path):
    data = tmp_path / "data.jsonl"
    data.write_text('{"text": "one"}\n\n{"text": "two", "id": 2}\n')
    assert read_documents(data) == ["one", "two"]
    data.write_text('{"text": "one"}\n{"body": "two"}\n')
    with pytest.raises(ValueError, match=r"line 2 has no string field 'text' \(it has \['body'\]\)"):
        read_documents(data)
    with pytest.raises(ValueError, match=r"line 1 has no string field 'body' \(it has \['text'\]\)"):
        read_documents(data, text_key="body")


def test_export_keeps_the_source_layout_dtypes_and_side_files(tmp_path):
    """Trained fp32 tensors go back to the source's bf16; a tied second name is left out unless the source has it."""
    from fabric_hsdp.checkpoint import write_dcp

    trained = {"embed.weight": torch.randn(8, 4), "norm.weight": torch.ones(4), "head.weight": torch.randn(8, 4)}
    trained["head.weight"] = trained["embed.weight"]  # tied
    write_dcp(tmp_path / "step-000002", trained)
    source = tmp_path / "source"
    source.mkdir()
    save_file(
        {"embed.weight": torch.zeros(8, 4, dtype=torch.bfloat16), "norm.weight": torch.ones(4)},
        source / "model.safetensors",
    )
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        (source / name).write_text("{}")
    written = export_model(tmp_path / "step-000002", "transformers", source, tmp_path / "hf", "5GB", {"head.weight"})
    exported = load_file(tmp_path / "hf" / "model.safetensors")
    assert sorted(exported) == ["embed.weight", "norm.weight"], written
    assert exported["embed.weight"].dtype == torch.bfloat16 and exported["norm.weight"].dtype == torch.float32
    assert torch.equal(exported["embed.weight"], trained["embed.weight"].bfloat16())
    assert sorted(path.name for path in (tmp_path / "hf").iterdir()) == [
        "config.json",
        "model.safetensors",
        "tokenizer.json",
        "tokenizer_config.json",
    ]

    torch.save({"embed.weight": torch.zeros(8, 4), "head.weight": torch.zeros(8, 4)}, source / "lit_model.pth")
    (source / "model_config.yaml").write_text("name: tiny\n")
    export_model(tmp_path / "step-000002", "litgpt", source, tmp_path / "lit", "5GB", {"head.weight"})
    state = torch.load(tmp_path / "lit" / "lit_model.pth", weights_only=True)
    assert sorted(state) == ["embed.weight", "head.weight", "norm.weight"]  # the source stores both names
    assert torch.equal(state["head.weight"], trained["embed.weight"])
    assert (tmp_path / "lit" / "model_config.yaml").read_text() == "name: tiny\n"


@pytest.fixture(scope="module")
def main_job(tmp_path_factory) -> Path:
    """The README's `make main` with 4 steps per format; its work directory."""
    work_dir = tmp_path_factory.mktemp("main_job")
    output = _run(
        [sys.executable, str(REPO_ROOT / "examples" / "main_job.py"), "--work_dir", str(work_dir), "--max_steps", "4"],
        timeout=600,
    )
    (work_dir / "output.txt").write_text(output)
    return work_dir


@pytest.mark.slow
@pytest.mark.timeout(600 + 60)  # the main_job fixture's 600 s, when this test runs first
def test_main_job_fine_tunes_both_formats_on_two_nodes_and_the_exports_reproduce_the_model(main_job):
    """A tiny Llama made in both formats, each fine-tuned by two `fabric run` launches (2 nodes x 2 ranks),
    exported, reloaded by litgpt / transformers.

    The reloaded export's logits must equal the fine-tuned (sharded) model's exactly: the same float32 weights and
    the same kernels on the same input. The validation losses may differ by summation order only (< 1e-5).
    """
    output, tmp_path = (main_job / "output.txt").read_text(), main_job
    assert "main job: all 5 steps passed" in output
    assert "layers found for sharding (the layers of its nn.ModuleLists): 2 x Block" in output
    assert "layers found for sharding (the layers of its nn.ModuleLists): 2 x LlamaDecoderLayer" in output
    assert "load_mode=slice" in output and "tokenizer: litgpt.Tokenizer" in output
    exports = {
        "litgpt": {"lit_model.pth", "model_config.yaml", "tokenizer.json", "tokenizer_config.json", "config.json"},
        "transformers": {"model.safetensors", "config.json", "tokenizer.json", "tokenizer_config.json"},
    }
    checks = {}
    for fmt, files in exports.items():
        assert files <= {path.name for path in (tmp_path / fmt / "export").iterdir()}
        checkpoints = sorted(path.name for path in (tmp_path / fmt / "checkpoints").iterdir())
        assert checkpoints == ["latest", "step-000002", "step-000004"]  # every max_steps / 2, and the last
        assert os.readlink(tmp_path / fmt / "checkpoints" / "latest") == "step-000004"
        checks[fmt] = check = json.loads((tmp_path / fmt / "export_check.json").read_text())
        assert check["format"] == fmt
        assert check["max_logit_diff"] == 0.0, check
        assert check["loss_diff"] < 1e-5, check
        assert check["val_loss"] < check["val_loss_before"], check
        assert check["generated"], check
    # one model in two formats, the same tokens: litgpt and transformers fine-tune it alike
    assert abs(checks["litgpt"]["val_loss"] - checks["transformers"]["val_loss"]) < 1e-4, checks


@pytest.mark.slow
@pytest.mark.timeout(600 + 180 + 30)  # the main_job fixture's 600 s, when this test runs first, and a 180 s launch
def test_finetune_resumes_from_its_sharded_checkpoint_exactly(main_job, tmp_path):
    """The main job's litgpt run without its last checkpoint, started again on 2 x 2 ranks: it resumes at step 2 and
    ends where the uninterrupted run ended, and exports again."""
    out_dir = tmp_path / "litgpt"
    shutil.copytree(main_job / "litgpt", out_dir, symlinks=True)  # `latest` stays a link, as cp -r keeps it
    shutil.rmtree(out_dir / "checkpoints" / "step-000004")
    shutil.rmtree(out_dir / "export")
    straight = json.loads((out_dir / "export_check.json").read_text())["fine_tuned_val_loss"]
    args = {"checkpoint_dir": str(main_job / "models" / "tiny-llama-litgpt"), "out_dir": str(out_dir)}
    launched = launch(finetune, {"args": {**args, "max_steps": 4, "save_every": 2}})
    output = launched.check().ranks[0].stdout
    assert f"resumed from {out_dir / 'checkpoints' / 'step-000002'} (step 2)" in output
    assert "step 0: val loss" not in output and "step 3/4: train loss" in output
    resumed = torch.load(out_dir / "export_check.pt", weights_only=True)["validation"]["val_loss"]
    assert resumed == straight
    assert (out_dir / "export" / "lit_model.pth").is_file()


@pytest.fixture(scope="module")
def tiny_models(tmp_path_factory) -> tuple[Path, Path]:
    """``(transformers directory, litgpt directory)`` of one tiny random Llama (examples/make_tiny_llama.py)."""
    from examples.make_tiny_llama import make_tiny_llama

    return make_tiny_llama(tmp_path_factory.mktemp("models"))


def _finetune(checkpoint_dir: Path, out_dir: Path) -> tuple[list[int | None], str, str]:
    """examples/finetune.py on 1 node x 2 ranks: the exit codes, the combined output and rank 0's stderr."""
    args = {"checkpoint_dir": str(checkpoint_dir), "out_dir": str(out_dir), "max_steps": 2, "export": False}
    result = launch(finetune, {"args": args}, num_nodes=1, timeout=150, fail_grace=60)
    return result.returncodes, "".join(rank.stdout + rank.stderr for rank in result.ranks), result.ranks[0].stderr


@pytest.mark.timeout(240)
def test_finetune_refuses_to_resume_another_models_checkpoint_and_names_both(tiny_models, tmp_path):
    """#34: it resumed the newest checkpoint in --out_dir whatever the model (DCP then named only tensors)."""
    from fabric_hsdp.checkpoint import write_dcp

    hf, litgpt = tiny_models
    saved = tmp_path / "checkpoints" / "step-000002"
    saved.parent.mkdir()
    lit_tensors = torch.load(litgpt / "lit_model.pth", weights_only=True)
    write_dcp(saved, lit_tensors, extras={"source": str(litgpt), "step": 2})
    codes, output, rank0 = _finetune(hf, tmp_path)
    assert codes == [1, 1], output
    reported = [line for line in output.splitlines() if "holds another model" in line]
    assert len(reported) == 1 and reported[0] in rank0, output
    assert reported[0].startswith(
        f"fabric-hsdp: error: checkpoint '{saved}' holds another model: it was saved fine-tuning '{litgpt}'"
        f" ({len(lit_tensors)} tensors), not --checkpoint_dir '{hf}'"
    ), reported
    assert "Pass another --out_dir, --resume false" in reported[0]
    assert "step 1/2" not in output and "resumed from" not in output


def test_finetune_names_a_checkpoint_of_the_same_tensors_saved_from_another_directory(tmp_path):
    from examples.finetune import check_same_model
    from fabric_hsdp.checkpoint import write_dcp
    from fabric_hsdp.errors import CheckpointError

    tensors = {"embed.weight": torch.zeros(8, 4), "head.weight": torch.zeros(8, 4)}
    shapes = {name: tuple(tensor.shape) for name, tensor in tensors.items()}
    write_dcp(tmp_path / "step-000001", tensors, extras={"source": str(tmp_path / "model"), "step": 1})
    assert check_same_model(tmp_path / "step-000001", tmp_path / "model", shapes) is None
    tied = {"norm.weight": (4,)}  # a second name of a tied weight may be absent from the checkpoint
    assert check_same_model(tmp_path / "step-000001", tmp_path / "model", {**shapes, **tied}, set(tied)) is None
    with pytest.raises(CheckpointError, match=r"the same tensor names and shapes, from another directory.*--resume "):
        check_same_model(tmp_path / "step-000001", tmp_path / "moved", shapes)
    note = check_same_model(tmp_path / "step-000001", tmp_path / "moved", shapes, chosen=True)  # --resume PATH
    assert note.startswith(f"resuming {tmp_path / 'step-000001'}, saved fine-tuning '{tmp_path / 'model'}'"), note
    with pytest.raises(
        CheckpointError, match=r"1 differ in shape \(e.g. 'head.weight' \[9, 4\] in the model, \[8, 4\]"
    ):
        check_same_model(tmp_path / "step-000001", tmp_path / "model", {**shapes, "head.weight": (9, 4)}, chosen=True)


@pytest.mark.timeout(240)
def test_finetune_stops_before_step_1_when_out_dir_is_unwritable(tiny_models, tmp_path):
    """#34: a read-only --out_dir failed at the first save, after the steps before it. /sys refuses even root."""
    out_dir = Path("/sys/fabric-hsdp-test-out")
    codes, output, rank0 = _finetune(tiny_models[1], out_dir)
    assert codes == [1, 1], output
    reported = [line for line in output.splitlines() if "fabric-hsdp: error" in line]
    assert reported == [
        f"fabric-hsdp: error: cannot save checkpoints in '{out_dir}': cannot create it (Operation not permitted)."
        " Found before training: choose a directory every rank can write, or change its permissions. (set"
        " FABRIC_HSDP_DEBUG=1 for the traceback)"
    ], output
    assert reported[0] in rank0
    assert "step 0: val loss" not in output and "step 1/2" not in output and "loaded" not in output


@pytest.mark.timeout(300)
def test_finetune_says_each_fact_of_the_job_once(tiny_models, tmp_path):
    """#34: every node's local rank 0 printed every line (fabric.print): one copy per node. 2 nodes x 2 ranks here."""
    args = {"checkpoint_dir": str(tiny_models[1]), "out_dir": str(tmp_path), "max_steps": 1, "export": False}
    result = launch(finetune, {"args": args}, timeout=200).check()
    output = "".join(rank.stdout + rank.stderr for rank in result.ranks)
    for fact in ("4 ranks = 2 node(s) x 2", "tokenizer: litgpt.Tokenizer", "ready in", "step 1/1: train loss", "done:"):
        assert len([line for line in output.splitlines() if line.startswith(fact)]) == 1, (fact, output)
    assert "done: fine-tuned val loss" in result.ranks[0].stdout


def _finetune_losses(checkpoint_dir: Path, out_dir: Path, num_nodes: int, devices: int, **parallel: int) -> dict:
    """examples/finetune.py (3 steps, the export too) on ``num_nodes x devices`` ranks: the train losses it printed,
    the validation losses and the probe's logits it recorded for the export's check."""
    args = {"checkpoint_dir": str(checkpoint_dir), "out_dir": str(out_dir), "max_steps": 3, "save_every": 0}
    args.update(batch_size=2, seq_len=32, max_val_windows=5, parallel=parallel)
    output = launch(finetune, {"args": args}, num_nodes=num_nodes, ranks_per_node=devices, timeout=200).check()
    stdout = output.ranks[0].stdout
    record = torch.load(out_dir / "export_check.pt", weights_only=True)
    return {
        "train": [float(_loss_at(step, stdout)) for step in (1, 2, 3)],
        "val": (record["validation"]["val_loss_before"], record["validation"]["val_loss"]),
        "logits": record["logits"],
        "stdout": stdout,
    }


@pytest.mark.slow
@pytest.mark.timeout(2 * 200 + 60)
@pytest.mark.parametrize("source", [0, 1], ids=["transformers", "litgpt"])
def test_finetune_with_context_parallelism_reports_the_losses_of_the_unsplit_run(tiny_models, tmp_path, source):
    """#42: --parallel.context_parallel_size 2 on 2 nodes x 2 ranks (2 data-parallel ranks, each sequence split over
    2) against 1 node x 2 ranks without it (the same 2 data-parallel ranks, so the same data): the training and
    validation losses and the export's probe logits are the same up to summation order; from a transformers
    directory and from a litgpt one (no position ids: one document per window)."""
    split = _finetune_losses(tiny_models[source], tmp_path / "cp2", 2, 2, context_parallel_size=2)
    whole = _finetune_losses(tiny_models[source], tmp_path / "cp1", 1, 2)
    assert "mesh (replicate, data_shard, context) = (2, 1, 2)" in split["stdout"], split["stdout"][-3000:]
    # printed to 4 decimals: one unit of the last digit for rounding at the print
    assert max(abs(a - b) for a, b in zip(split["train"], whole["train"], strict=True)) <= 1.5e-4, (split, whole)
    assert max(abs(a - b) for a, b in zip(split["val"], whole["val"], strict=True)) < 1e-5, (split, whole)
    assert split["val"][1] < split["val"][0]  # it trained
    assert split["logits"].shape == whole["logits"].shape
    assert (split["logits"] - whole["logits"]).abs().max() < 1e-4
