import errno
import json
import os
import random
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from fabric_hsdp.cli import main


def tree(directory: Path) -> list[str]:
    return sorted(str(path.relative_to(directory)) for path in directory.rglob("*"))


@pytest.fixture
def checkpoint(tmp_path):
    torch.save({"model": {"w": torch.arange(12.0).reshape(3, 4), "b": torch.ones(3)}, "step": 5}, tmp_path / "in.ckpt")
    return tmp_path / "in.ckpt"


def run(capsys, *args):
    code = main([str(arg) for arg in args])
    out, err = capsys.readouterr()
    return code, out, err


@pytest.mark.parametrize("dtype", ["bf16", "bfloat16", "torch.bfloat16"])
def test_convert_and_inspect(tmp_path, checkpoint, capsys, dtype):
    code, out, err = run(capsys, "convert", checkpoint, tmp_path / "out", "--dtype", dtype)
    assert code == 0
    assert out == ""
    assert err.startswith("fabric-hsdp: converted 2 tensors (30 B) with optimizer/extras from fabric to dcp in ")
    assert err.count("\n") == 1
    code, out, _ = run(capsys, "inspect", tmp_path / "out", "--json")
    info = json.loads(out)
    assert (code, info["format"], info["tensors"], info["dtypes"]) == (0, "dcp", 2, {"bfloat16": 2})
    assert info["extras"] == {"step": {"tensors": 0, "bytes": 0, "type": "int", "value": 5}}
    code, out, _ = run(capsys, "inspect", checkpoint)
    assert code == 0
    assert out.splitlines()[:3] == [
        f"{checkpoint}: fabric",
        "  tensors: 2  parameters: 15  size: 60 B",
        "  dtypes: float32 x2",
    ]
    assert "  extra 'step': 5 (int)" in out.splitlines()  # issue #34: the value, not only its type


def test_inspect_shows_small_extras_whole_and_large_ones_by_size(tmp_path, capsys):
    state = {"model": {"w": torch.ones(2)}, "seed": "x" * 81, "optimizer": {"state": {0: {"m": torch.ones(4)}}}}
    torch.save(state, tmp_path / "in.ckpt")
    code, out, _ = run(capsys, "inspect", tmp_path / "in.ckpt")
    assert code == 0
    assert "  extra 'seed': str, 0 tensors, 0 B" in out.splitlines()  # a long string is not printed whole
    assert "  extra 'optimizer': dict, 1 tensors, 16 B" in out.splitlines()


def test_config_file(tmp_path, checkpoint, capsys):
    config = tmp_path / "convert.yaml"
    config.write_text(f"source: {checkpoint}\ndest: {tmp_path / 'out.safetensors'}\nkey_map: ['w=weight']\n")
    code, _, err = run(capsys, "convert", "--config", config)
    assert code == 0, err
    from safetensors.torch import load_file

    assert sorted(load_file(tmp_path / "out.safetensors")) == ["b", "weight"]


def _write_random(path):
    # fixed bytes, and none of the formats' magic numbers at the start (0x80 would be a legacy torch pickle)
    path.write_bytes(b"\x17" + random.Random(0).randbytes(4095))


def _write_truncated_zip(path):
    torch.save({"w": torch.ones(4096)}, path)
    path.write_bytes(path.read_bytes()[:5000])


def _write_truncated_safetensors(path):
    save_file({"w": torch.ones(4096)}, path)
    path.write_bytes(path.read_bytes()[:5000])


def test_hf_config_option_puts_config_json_into_a_hugging_face_directory(tmp_path, capsys):
    from tests.helpers.training import tiny_hf_llama

    model = tiny_hf_llama()  # the config must describe the tensors (#44): a Fabric checkpoint of this model
    torch.save({"model": model.state_dict(), "step": 5}, tmp_path / "in.ckpt")
    model.config.save_pretrained(tmp_path / "model")
    config = tmp_path / "model" / "config.json"
    code, _, err = run(
        capsys, "convert", tmp_path / "in.ckpt", tmp_path / "hf", "--to", "safetensors", "--hf_config", config
    )
    assert code == 0, err
    assert (tmp_path / "hf" / "config.json").read_text() == config.read_text()
    # a config of another model is refused, naming it (the model it builds lacks the checkpoint's tensors)
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "config.json").write_text('{"model_type": "llama"}')  # transformers' default Llama
    code, _, err = run(
        capsys,
        "convert",
        tmp_path / "in.ckpt",
        tmp_path / "hf2",
        "--to",
        "safetensors",
        "--hf_config",
        tmp_path / "other",
    )
    assert code == 2 and "does not describe the checkpoint's tensors" in err and not (tmp_path / "hf2").exists(), err


@pytest.mark.parametrize(
    ("make", "name", "message"),
    [
        (None, "missing.pth", "checkpoint '{path}' does not exist"),
        (_write_random, "random.pth", "'{path}' is not a checkpoint (unrecognised content). Accepted: a torch file"),
        (_write_truncated_zip, "cut.pth", "'{path}' is a truncated or damaged torch file (PytorchStreamReader failed"),
        (_write_truncated_safetensors, "cut.safetensors", "'{path}' is truncated: tensor 'w' ends at byte"),
        (lambda path: path.mkdir(), "emptydir", "directory '{path}' is not a checkpoint (it holds nothing)."),
    ],
    ids=["missing", "random-bytes", "truncated-zip", "truncated-safetensors", "empty-directory"],
)
@pytest.mark.parametrize("dest_name", ["out", "out.pth", "out.safetensors"])
def test_bad_input_exits_2_with_one_line_and_no_output(tmp_path, capsys, make, name, message, dest_name):
    path = tmp_path / name
    if make is not None:
        make(path)
    before = tree(tmp_path)
    code, out, err = run(capsys, "convert", path, tmp_path / dest_name)
    assert code == 2
    assert out == ""
    assert err.startswith("fabric-hsdp: error: " + message.format(path=path))
    assert err.count("\n") == 1 and "Traceback" not in err
    assert tree(tmp_path) == before


def test_existing_dest_is_never_touched_without_overwrite(tmp_path, checkpoint, capsys):
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "precious.txt").write_text("keep me")
    code, _, err = run(capsys, "convert", checkpoint, tmp_path / "out")
    assert code == 2
    assert err == (
        f"fabric-hsdp: error: '{tmp_path / 'out'}' already exists; pass overwrite=True (CLI: --overwrite) to"
        " replace it\n"
    )
    assert tree(tmp_path / "out") == ["precious.txt"]
    code, _, _ = run(capsys, "convert", checkpoint, tmp_path / "out", "--overwrite")
    assert code == 0
    assert sorted(tree(tmp_path / "out")) == [".metadata", "__0_0.distcp", "meta.pt"]


def test_bad_arguments_exit_2_with_one_line(tmp_path, checkpoint, capsys):
    code, out, err = run(capsys, "convert", checkpoint, tmp_path / "o", "--to", "zip")
    assert (code, out) == (2, "")
    assert err == (
        "fabric-hsdp: error: argument --to: invalid choice: 'zip' (choose from 'dcp', 'torch', 'safetensors')"
        " (see fabric-hsdp --help)\n"
    )
    code, _, err = run(capsys, "convert", checkpoint, tmp_path / "o", "--max_shard_size", "0", "--to", "safetensors")
    assert (code, err) == (2, "fabric-hsdp: error: max_shard_size='0' must be positive\n")
    code, _, err = run(capsys, "convert", checkpoint, tmp_path / "o", "--dtype", "int8")
    assert code == 2 and err.startswith("fabric-hsdp: error: dtype 'int8' is not one of bf16, bfloat16,")
    code, _, err = run(capsys, "convert", checkpoint, tmp_path / "o", "--key_map", "nonsense")
    assert (code, err) == (
        2,
        "fabric-hsdp: error: key_map rule 'nonsense' is not 'OLD=NEW' (rename a prefix), 'OLD='"
        " (strip it) or '!OLD' (drop keys)\n",
    )
    assert not (tmp_path / "o").exists()


def test_debug_shows_the_traceback(tmp_path, capsys):
    code, _, err = run(capsys, "--debug", "inspect", tmp_path / "nothing.pth")
    assert code == 2
    assert "Traceback (most recent call last)" in err
    assert err.endswith(f"fabric-hsdp: error: checkpoint '{tmp_path / 'nothing.pth'}' does not exist\n")


@pytest.fixture
def tiny_disk(tmp_path):
    mount_point = tmp_path / "disk"
    mount_point.mkdir()
    result = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(mount_point)], capture_output=True)
    if result.returncode != 0:
        pytest.skip(f"cannot mount a 1 MiB tmpfs to fill ({result.stderr.decode().strip() or 'mount failed'})")
    yield mount_point
    subprocess.run(["umount", str(mount_point)], check=False)


@pytest.mark.parametrize("dest_name", ["out", "out.pth", "out.safetensors", "hf"])
def test_disk_full_exits_1_and_leaves_nothing(tmp_path, tiny_disk, capsys, dest_name):
    torch.save({"a": torch.ones(1 << 19), "b": torch.ones(10)}, tmp_path / "2mib.pth")
    extra = ["--to", "safetensors"] if dest_name == "hf" else []
    code, _, err = run(capsys, "convert", tmp_path / "2mib.pth", tiny_disk / dest_name, *extra)
    assert code == 1
    assert err == f"fabric-hsdp: error: No space left on device: '{tiny_disk / dest_name}'\n"
    assert tree(tiny_disk) == []


@pytest.fixture
def read_only_dir(tmp_path):
    mount_point = tmp_path / "read-only"
    mount_point.mkdir()
    result = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "ro,size=1m", "tmpfs", str(mount_point)], capture_output=True
    )
    if result.returncode != 0:
        pytest.skip(f"cannot mount a read-only tmpfs ({result.stderr.decode().strip() or 'mount failed'})")
    yield mount_point
    subprocess.run(["umount", str(mount_point)], check=False)


@pytest.mark.parametrize("dest_name", ["out", "out.pth", "out.safetensors", "hf"])
def test_unwritable_destination_names_it_not_the_pending_path(
    tmp_path, checkpoint, read_only_dir, capsys, monkeypatch, dest_name
):
    """Root writes through chmod, so the refusals are a read-only mount, /proc and a planted failed rename."""
    extra = ["--to", "safetensors"] if dest_name == "hf" else []
    for directory, reason in [(read_only_dir, "Read-only file system"), (Path("/proc"), "No such file or directory")]:
        dest = directory / dest_name
        code, out, err = run(capsys, "convert", checkpoint, dest, *extra)
        assert (code, out) == (1, "")
        assert err.splitlines()[-1] == (  # a .safetensors output says first that 'step' is left out
            f"fabric-hsdp: error: cannot write '{dest}': directory '{directory}' is not writable ({reason}); choose"
            f" a writable directory. Nothing was written at '{dest}'; what was there before, if anything, is intact."
        )
    from fabric_hsdp.checkpoint.core import commit

    def refuse(pending, path):
        raise OSError(errno.EROFS, "Read-only file system", str(pending))

    monkeypatch.setattr(commit, "commit", refuse)  # everything is written; the final rename is refused
    code, _, err = run(capsys, "convert", checkpoint, tmp_path / dest_name, *extra)
    assert code == 1 and ".tmp-" not in err, err
    assert err.splitlines()[-1].startswith(
        f"fabric-hsdp: error: cannot write '{tmp_path / dest_name}': directory '{tmp_path}' is not writable"
    )
    assert not [path for path in tmp_path.iterdir() if path.name.startswith(".")]
    code, _, err = run(capsys, "convert", checkpoint, checkpoint / dest_name, *extra)  # its parent is a file
    assert (code, err) == (
        2,
        f"fabric-hsdp: error: cannot write '{checkpoint / dest_name}': '{checkpoint}' is a file, not a directory\n",
    )


@pytest.mark.parametrize(
    ("dest", "slowed", "sent"),
    [
        (dest, slowed, signal.SIGINT)
        for dest in ("out", "out.pth", "out.safetensors")
        for slowed in ("reading", "writing")
    ]
    # SIGTERM: what scancel and a job's time limit send
    + [(dest, "writing", signal.SIGTERM) for dest in ("out", "out.pth", "out.safetensors")],
)
def test_sigint_or_sigterm_mid_conversion_exits_130_or_143_and_leaves_nothing(tmp_path, dest, slowed, sent):
    torch.save({f"w{i}": torch.ones(2 << 20) for i in range(8)}, tmp_path / "big.pth")  # 64 MiB
    env = dict(os.environ, PYTHONPATH=str(Path(__file__).parents[1]))
    # each tensor read (or each 16 MiB written) takes 0.5 s longer, so the interrupt lands there even when the
    # machine is idle: inside torch's zip writer for "writing" to a DCP directory or a torch file
    patch = {
        "reading": "from fabric_hsdp.checkpoint.core.lazy_tensor import LazyTensor as C; slow = C.read;"
        " C.read = lambda self, out=None: (time.sleep(0.5), slow(self, out))[1];",
        "writing": "from fabric_hsdp.checkpoint.core.fileio import DirectFileWriter as C; slow = C._write_all;"
        " C._write_all = lambda self, view: (time.sleep(0.5), slow(self, view))[1];",
    }[slowed]
    slowed = f"import sys, time; from fabric_hsdp import cli; {patch} sys.exit(cli.main(sys.argv[1:]))"
    process = subprocess.Popen(
        [sys.executable, "-c", slowed, "convert", str(tmp_path / "big.pth"), str(tmp_path / dest)],
        stderr=subprocess.PIPE,
        text=True,
        env=env,
        # as in a terminal: a runner started in the background (`cmd &`) ignores SIGINT, and so would the child
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )
    deadline = time.monotonic() + 120
    while not list(tmp_path.glob(f".{dest}.tmp-*")) and process.poll() is None and time.monotonic() < deadline:
        time.sleep(0.002)
    assert process.poll() is None, f"the conversion ended before it could be interrupted: {process.stderr.read()}"
    process.send_signal(sent)
    _, err = process.communicate(timeout=60)
    assert process.returncode == {signal.SIGINT: 130, signal.SIGTERM: 143}[sent], err
    assert err.splitlines()[-1] == "fabric-hsdp: interrupted; nothing was written"
    assert sorted(path.name for path in tmp_path.iterdir()) == ["big.pth"]


def test_staging_left_by_a_killed_conversion_is_removed_by_the_next(tmp_path, checkpoint, capsys):
    """kill -9 leaves .NAME.tmp-*: the next write of NAME removes it and says so; a live writer's is left alone."""
    killed = tmp_path / ".out.pth.tmp-0123456789ab"
    (killed / "out.pth").parent.mkdir()
    (killed / "out.pth").write_bytes(b"x" * 3000)
    (killed / ".owner").write_text(f"{socket.gethostname()} {2**22 + 1}")  # above pid_max's default: no such process
    live = tmp_path / ".out.pth.tmp-ba9876543210"
    live.mkdir()
    (live / ".owner").write_text(f"{socket.gethostname()} {os.getppid()}")
    other = tmp_path / ".other.pth.tmp-0123456789ab"  # another destination's: not ours to judge
    other.mkdir()
    code, _, err = run(capsys, "convert", checkpoint, tmp_path / "out.pth")
    assert code == 0, err
    assert (
        f"fabric-hsdp: removing '{killed}' (2.9 KiB), left by an interrupted write of '{tmp_path / 'out.pth'}'" in err
    )
    assert f"is being written by process {os.getppid()} on this host (pending '{live}')" in err
    assert not killed.exists() and live.exists() and other.exists() and (tmp_path / "out.pth").is_file()


def test_a_reader_that_stops_early_is_not_an_error(checkpoint):
    """`fabric-hsdp inspect x | head`: the pipe closes before the output is written."""
    read_end, write_end = os.pipe()
    os.close(read_end)
    env = dict(os.environ, PYTHONPATH=str(Path(__file__).parents[1]))
    result = subprocess.run(
        [sys.executable, "-m", "fabric_hsdp", "inspect", str(checkpoint)],
        stdout=write_end,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
        timeout=120,
    )
    os.close(write_end)
    assert (result.returncode, result.stderr) == (0, "")


def test_the_command_imports_neither_lightning_nor_the_strategy():
    code = (
        "import json, sys, fabric_hsdp.cli, fabric_hsdp.checkpoint, fabric_hsdp.checkpoint.writers.convert;"
        " print(json.dumps(sorted(sys.modules)))"
    )
    env = dict(os.environ, PYTHONPATH=str(Path(__file__).parents[1]))
    output = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env)
    modules = json.loads(output.stdout)
    assert [name for name in modules if name == "lightning" or name.startswith("lightning.")] == []
    assert "fabric_hsdp.strategy" not in modules and "fabric_hsdp.checkpoint.writers.convert" in modules
