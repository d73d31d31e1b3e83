"""Scenarios for sharded and full checkpoints: save, resharded load, interop, kills and failures."""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from tests.helpers.counters import ReadCounter
from tests.helpers.training import (
    build,
    expected_state,
    full_optimizer_state,
    full_state,
    layer_class,
    make_fabric,
    setup_training,
    train_steps,
)


def save(
    num_nodes: int,
    devices: int,
    out: str,
    state_dict_type: str = "sharded",
    name: str = "ckpt",
    model_only: bool = False,
) -> dict:
    """Train 2 steps, save, and record the exact expected state (rank 0 writes expected.pt)."""
    fabric = make_fabric(num_nodes, devices, sharded_modules={layer_class("llama")}, state_dict_type=state_dict_type)
    model, optimizer, scheduler = setup_training(fabric, empty_init=False)
    train_steps(fabric, model, optimizer, scheduler, steps=2)
    expected = expected_state(model, optimizer, scheduler)
    path = Path(out) / name
    state = {"model": model, "optimizer": optimizer, "scheduler": scheduler, "step": 2, "note": "hi"}
    fabric.save(path, {"model": model} if model_only else state)
    if fabric.global_rank == 0:
        torch.save(expected, Path(out) / "expected.pt")
    hidden = sorted(p.name for p in Path(out).iterdir() if p.name.startswith("."))
    return {"exists": path.exists(), "hidden_leftovers": hidden}


def load(
    num_nodes: int,
    devices: int,
    out: str,
    name: str = "ckpt",
    shard_size: Any = "node",
    split_replica_reads: bool = False,
    **kw: Any,
) -> dict:
    """Load into a meta-initialised model on this topology and compare with expected.pt exactly."""
    fabric = make_fabric(
        num_nodes,
        devices,
        sharded_modules={layer_class("llama")},
        shard_size=shard_size,
        split_replica_reads=split_replica_reads,
    )
    model, optimizer, scheduler = setup_training(fabric, empty_init=True, seed=99)
    state = {"model": model, "optimizer": optimizer, "scheduler": scheduler, "step": 0}
    steps = []  # a load must not step the optimizer (DCP would, to create a fresh optimizer's state)
    hook = optimizer.optimizer.register_step_pre_hook(lambda *_: steps.append(1))
    remainder = fabric.load(Path(out) / name, state, **kw)
    hook.remove()
    expected = torch.load(Path(out) / "expected.pt", weights_only=False)
    actual_model = full_state(model.module)
    actual_optimizer = full_optimizer_state(model.module, optimizer.optimizer)
    model_equal = {k: torch.equal(actual_model[k], v) for k, v in expected["model"].items()}
    optimizer_equal = {
        f"{fqn}.{key}": (torch.equal(value, actual_optimizer[fqn][key]) if isinstance(value, torch.Tensor) else None)
        for fqn, entries in expected["optimizer"].items()
        for key, value in entries.items()
    }
    return {
        "model_equal": model_equal,
        "optimizer_equal": optimizer_equal,
        "optimizer_keys": sorted({key for entries in actual_optimizer.values() for key in entries}),
        "optimizer_steps_during_load": len(steps),
        "step": state["step"],
        "scheduler_equal": scheduler.state_dict() == expected["scheduler"],
        "lr": optimizer.param_groups[0]["lr"],
        "expected_lr": expected["scheduler"]["_last_lr"][0],
        "remainder": remainder,
    }


def save_with_lightning(num_nodes: int, devices: int, out: str) -> dict:
    """Lightning's own ModelParallelStrategy writes a DCP checkpoint of the same model (FSDP2 over all ranks)."""
    import lightning as L
    from lightning.fabric.strategies import ModelParallelStrategy
    from torch.distributed.fsdp import fully_shard

    def parallelize(model: torch.nn.Module, mesh: Any) -> torch.nn.Module:
        for layer in model.layers:
            fully_shard(layer, mesh=mesh["data_parallel"])
        fully_shard(model, mesh=mesh["data_parallel"])
        return model

    strategy = ModelParallelStrategy(parallelize, data_parallel_size=num_nodes * devices, tensor_parallel_size=1)
    fabric = L.Fabric(accelerator="cpu", devices=devices, num_nodes=num_nodes, strategy=strategy)
    fabric.launch()
    model, optimizer, scheduler = setup_training(fabric, empty_init=False)
    train_steps(fabric, model, optimizer, scheduler, steps=2)
    expected = expected_state(model, optimizer, scheduler)
    fabric.save(Path(out) / "ckpt", {"model": model, "optimizer": optimizer, "scheduler": scheduler, "step": 2})
    if fabric.global_rank == 0:
        torch.save(expected, Path(out) / "expected.pt")
    return {}


def save_in_background(num_nodes: int, devices: int, out: str) -> dict:
    """async_save: save after 2 steps, then train on while the write is held back until that step is done.

    The checkpoint must hold the state of the moment ``fabric.save`` was called, not the later one (and a
    ``fabric.save`` that waited for the write would never return). The script then ends: the save must still be
    finished and committed.
    """
    from torch.distributed.checkpoint import filesystem

    fabric = make_fabric(num_nodes, devices, sharded_modules={layer_class("llama")}, async_save=True)
    model, optimizer, scheduler = setup_training(fabric, empty_init=False)
    train_steps(fabric, model, optimizer, scheduler, steps=2)
    expected = expected_state(model, optimizer, scheduler)
    if fabric.global_rank == 0:
        torch.save(expected, Path(out) / "expected.pt")
    write_data = filesystem.FileSystemWriter.write_data
    release = threading.Event()

    def held_write_data(self: Any, plan: Any, planner: Any) -> Any:
        if not release.wait(timeout=60):  # in DCP's writing thread
            raise TimeoutError("the write was never released: fabric.save blocked on it")
        return write_data(self, plan, planner)

    filesystem.FileSystemWriter.write_data = held_write_data
    path = Path(out) / "ckpt"
    fabric.save(path, {"model": model, "optimizer": optimizer, "scheduler": scheduler, "step": 2, "note": "hi"})
    visible_before_written = path.exists()
    train_steps(fabric, model, optimizer, scheduler, steps=1)  # changes parameters, AdamW state and lr in place
    release.set()
    return {"visible_before_written": visible_before_written}  # the script ends with the save pending


# Where a killed save dies, in the order a save passes them, and what must then be at the path.
KILL_POINTS = {
    "before_write": "old",  # in DCP's write_data, before this rank wrote a byte
    "mid_write": "old",  # in the fsync of this rank's first data file: its bytes written, the file not finished
    "after_write": "old",  # this rank's files all written, before the commit
    "after_commit": "new",  # rank 0: the swap into place done, fabric.save not yet returned
    "after_save": "new",  # fabric.save (and, in the background, the wait) returned
}


def _arm_kill(point: str, marker: Path) -> None:
    """Make this rank SIGKILL itself when the save reaches ``point``, writing ``marker`` first (where it died).

    The kill is triggered by the save's own progress (hooks in DCP's writer and in the commit), not by a timer, so
    where it lands does not depend on the machine's load.
    """
    from torch.distributed.checkpoint import filesystem

    from fabric_hsdp.checkpoint.core import commit

    def die(where: str) -> None:
        marker.write_text(where)
        os.kill(os.getpid(), signal.SIGKILL)

    write_data, fsync, commit_swap = filesystem.FileSystemWriter.write_data, os.fsync, commit.commit
    writing = threading.Event()

    def hooked_write_data(self: Any, plan: Any, planner: Any) -> Any:
        if point == "before_write":
            die(point)
        writing.set()
        future = write_data(self, plan, planner)
        future.wait()  # done (thread_count 1 writes in this thread): an error would surface here
        if point == "after_write":
            die(point)
        return future

    def hooked_fsync(fd: int) -> None:
        if point == "mid_write" and writing.is_set() and os.fstat(fd).st_size > 0:
            die(point)
        fsync(fd)

    def hooked_commit(staged: Path, path: Path) -> None:
        commit_swap(staged, path)
        if point == "after_commit":
            die(point)

    filesystem.FileSystemWriter.write_data = hooked_write_data
    filesystem.os.fsync = hooked_fsync
    commit.commit = hooked_commit


def feed_forward_only(model: torch.nn.Module, mesh: Any) -> None:
    """A callable tensor-parallel plan: the example LLaMA's feed-forward blocks only (attention stays whole)."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    for layer in model.layers:
        plan = {"w1": ColwiseParallel(), "w3": ColwiseParallel(), "w2": RowwiseParallel()}
        parallelize_module(layer.feed_forward, mesh, plan, src_data_rank=None)


# Plans a launched run takes: "auto" (the model's _tp_plan), a dict of style names, a callable.
TENSOR_PARALLEL_PLANS = {
    "auto": "auto",
    "dict": {
        "layers.*.feed_forward.w1": "colwise",
        "layers.*.feed_forward.w3": "colwise",
        "layers.*.feed_forward.w2": "rowwise",
        "output": "colwise_gather_output",
    },
    "callable": feed_forward_only,
}


def save_then_killed(
    num_nodes: int,
    devices: int,
    out: str,
    point: str,
    victim: int,
    async_save: bool = False,
    tensor_parallel_size: int = 1,
    tensor_parallel_plan: str = "auto",
) -> dict:
    """Save A, train, then save B over it while rank ``victim`` SIGKILLs itself at ``point`` of that save.

    Rank 0 writes which parameters tensor parallelism split (``split.json``): the plan given took effect.
    """
    fabric = make_fabric(
        num_nodes,
        devices,
        sharded_modules={layer_class("llama")},
        async_save=async_save,
        tensor_parallel_size=tensor_parallel_size,
        tensor_parallel_plan=TENSOR_PARALLEL_PLANS[tensor_parallel_plan],
    )
    model, optimizer, scheduler = setup_training(fabric, empty_init=False)
    if fabric.global_rank == 0:
        split = sorted(name for name, p in model.module.named_parameters() if len(p.placements) == 3)
        (Path(out) / "split.json").write_text(json.dumps(split))
    path = Path(out) / "ckpt"
    state = {"model": model, "optimizer": optimizer, "step": 1}
    train_steps(fabric, model, optimizer, scheduler, steps=1)
    fabric.save(path, state)
    fabric.strategy.wait_for_checkpoint()
    expected_a = full_state(model.module)  # gathers are collectives: every rank takes part
    train_steps(fabric, model, optimizer, scheduler, steps=1)
    state["step"] = 2
    expected_b = full_state(model.module)
    if fabric.global_rank == 0:
        torch.save(expected_a, Path(out) / "expected_a.pt")
        torch.save(expected_b, Path(out) / "expected_b.pt")
    fabric.barrier()
    marker = Path(out) / "killed_at"
    if fabric.global_rank == victim:
        _arm_kill(point, marker)
    fabric.save(path, state)
    fabric.strategy.wait_for_checkpoint()
    if fabric.global_rank == victim:
        assert point == "after_save", f"the save returned on rank {victim} although it was to die at {point}"
        marker.write_text(point)
        os.kill(os.getpid(), signal.SIGKILL)
    fabric.barrier()  # the others stay until the victim is gone: the launcher ends them
    return {}


def fail_writing_on_one_rank(
    num_nodes: int, devices: int, out: str, failing_rank: int, async_save: bool = False, wait: bool = True
) -> dict:
    """Save once; then one rank's disk refuses writes (permission denied) during the next save."""
    import errno

    from torch.distributed.checkpoint import filesystem

    fabric = make_fabric(num_nodes, devices, sharded_modules={layer_class("llama")}, async_save=async_save)
    model, optimizer, scheduler = setup_training(fabric, empty_init=False)
    path = Path(out) / "ckpt"
    fabric.save(path, {"model": model, "optimizer": optimizer, "step": 1})
    fabric.strategy.wait_for_checkpoint()
    expected = full_state(model.module)
    if fabric.global_rank == 0:
        torch.save(expected, Path(out) / "expected.pt")
    train_steps(fabric, model, optimizer, scheduler, steps=1)
    write_data = filesystem.FileSystemWriter.write_data
    if fabric.global_rank == failing_rank:

        def refuse(self: Any, plan: Any, planner: Any) -> Any:
            raise PermissionError(errno.EACCES, "Permission denied", str(self.path))

        filesystem.FileSystemWriter.write_data = refuse
    started = time.monotonic()
    try:
        fabric.save(path, {"model": model, "optimizer": optimizer, "step": 2})
        if not wait:
            return {"error": None, "seconds": time.monotonic() - started}  # the script ends with the save pending
        fabric.strategy.wait_for_checkpoint()  # a background save's failure is raised here
    except Exception as error:
        failed = {"error": f"{type(error).__name__}: {error}", "seconds": time.monotonic() - started}
    else:
        return {"error": None, "seconds": time.monotonic() - started}
    filesystem.FileSystemWriter.write_data = write_data
    failed["rank0_unwritable"] = _save_where_rank0_cannot_write(fabric, model, optimizer, Path(out), path)
    return failed


def _save_where_rank0_cannot_write(fabric: Any, model: Any, optimizer: Any, out: Path, path: Path) -> dict[str, str]:
    """Two saves whose rank 0 gets an OSError: the checkpoint's parent is a regular file (creating the pending
    directory fails), and the final rename is refused (a read-only filesystem, planted); each rank's error by case."""
    import errno

    from fabric_hsdp.checkpoint.core import commit

    if fabric.global_rank == 0:
        (out / "a_file").write_text("not a directory")
    fabric.barrier()
    errors = {}
    commit_for_real = commit.commit
    for case, target in [("parent_is_a_file", out / "a_file" / "ckpt"), ("commit_refused", path)]:
        if case == "commit_refused" and fabric.global_rank == 0:

            def refuse(staged: Path, path: Path) -> None:
                raise OSError(errno.EROFS, "Read-only file system", str(staged))

            commit.commit = refuse
        try:
            fabric.save(target, {"model": model, "optimizer": optimizer, "step": 3})
            fabric.strategy.wait_for_checkpoint()
            errors[case] = "no error"
        except Exception as error:
            errors[case] = f"{type(error).__name__}: {error}"
        finally:
            commit.commit = commit_for_real
    if fabric.global_rank == 0:
        (out / "a_file").unlink()
    fabric.barrier()
    return errors


def load_raw_state(num_nodes: int, devices: int, out: str, name: str) -> dict:
    """Load a checkpoint holding only model weights; compare to expected.pt's model entry."""
    fabric = make_fabric(num_nodes, devices, sharded_modules={layer_class("llama")})
    with fabric.init_module(empty_init=True):
        model = build("llama", seed=5)
    model = fabric.setup_module(model)
    fabric.load_raw(Path(out) / name, model)
    expected = torch.load(Path(out) / "expected.pt", weights_only=False)["model"]
    actual = full_state(model.module)
    dist.barrier()
    return {"model_equal": {k: torch.equal(actual[k], v) for k, v in expected.items()}}


def load_counting_reads(num_nodes: int, devices: int, out: str, split_replica_reads: bool) -> dict:
    """``load`` on this topology, counting the tensor bytes this rank reads from the checkpoint's files."""
    counter = ReadCounter()
    facts = load(num_nodes, devices, out, split_replica_reads=split_replica_reads)
    return dict(facts, bytes_read=counter.bytes)


def split_parts(num_nodes: int, devices: int) -> dict:
    """What each rank of a 2 x 2 mesh reads of two (Replicate, Shard(0)) tensors, and what the gather puts back."""
    from torch.distributed.tensor import DTensor, Replicate, Shard

    from fabric_hsdp.checkpoint.training.replica_split import gather, replica_parts

    fabric = make_fabric(num_nodes, devices)
    mesh = fabric.strategy.device_mesh
    even = torch.arange(8 * 3, dtype=torch.float32).view(8, 3)  # 8 rows: 4 parts of 2
    uneven = torch.arange(6 * 2, dtype=torch.float32).view(6, 2)  # 6 rows do not split into 4 parts
    placements = [Replicate(), Shard(0)]
    state = {
        "model": {"even": DTensor.from_local(even.chunk(2)[mesh.get_local_rank(1)].clone(), mesh, placements)},
        "other": [{"uneven": DTensor.from_local(uneven.chunk(2)[mesh.get_local_rank(1)].clone(), mesh, placements)}],
    }
    targets, _, splits = replica_parts(state, fabric.strategy.parallel_mesh, {})
    part = targets["model"]["even"]
    (chunk,) = part.__create_chunk_list__()  # where DCP reads this rank's part from
    whole = state["model"]["even"].to_local()
    facts = {
        "coordinate": mesh.get_coordinate(),
        "part_offset_rows": chunk.offsets[0],
        "part_rows": chunk.sizes[0],
        "uneven_kept": targets["other"][0]["uneven"] is state["other"][0]["uneven"],
        "splits": len(splits),
        "shares_memory": part.local.data_ptr() == whole.data_ptr(),
    }
    # as a load would: this rank's part holds its rows, the rest of the shard is stale until the gather
    whole.zero_()
    offset = facts["part_offset_rows"]
    splits[0].part.copy_(even[offset : offset + facts["part_rows"]])
    gather(splits, fabric.strategy.parallel_mesh)
    facts["shard_after_gather_exact"] = torch.equal(whole, even.chunk(2)[mesh.get_local_rank(1)])
    return facts
