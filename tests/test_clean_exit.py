"""Every rank ends with the status its script earned, every time: 0 after a plain training script, 1 after an error.

What this guards (fabric_hsdp/processes/teardown.py): ranks that ran an FSDP2 forward can abort at interpreter exit
("terminate called without an active exception", exit 134) when the process group is destroyed before the FSDP2
states that reference it; the strategy's exit handler releases the states first, then destroys the group, on the
success path and on the error path (a failing load, where the traceback keeps the model alive through the exit).

What it can and cannot catch here: the abort itself does not reproduce on this machine's torch (CPU build, gloo):
with the exit handler removed (``atexit.register`` dropped), 10 fork-server and 4 fresh-process launches all exited
``[0, 0, 0, 0]`` (#22's review), and #20's intermittent exit 134 (1 in ~10 failing loads, 2 ranks under Fabric)
was not reproduced either; each run still looks for it (``ABORTS``). What it does catch is the exit status: a
handler that ends the process its own way (plant 4 in tests/mutations: ``os._exit(0)``, the obvious way to dodge the
abort) turns a failing load's exit 1 into 0, and the test fails on the runs with a failing load.

The abort was seen once since, in CI's ``srun --distribution=cyclic`` test: a rank failing the rank-layout check,
with its process group alive and the exit handler not yet registered. That path is guarded deterministically below
(the group must be gone before the interpreter's teardown), not by waiting for the abort.
"""

from __future__ import annotations

import os
from typing import Any

import pytest
import torch
import torch.distributed as dist

from tests.helpers.launch import launch
from tests.helpers.training import batch, build, layer_class, make_fabric

pytestmark = pytest.mark.slow

# Each of the four kinds once (plain and TP, training that ends and a failing load): the abort this once hunted does
# not reproduce here (above), and a wrong exit status shows on the first run of its kind (#46: 20 runs were 5x this).
RUNS = 4
ABORTS = ("terminate called", "Fatal Python error", "core dumped")


@pytest.mark.timeout(RUNS * 120 + 60)  # each launch has its own 120 s limit
def test_consecutive_launches_of_each_kind_exit_with_their_status(tmp_path):
    state = build("llama").state_dict()
    del state["layers.1.feed_forward.w1.weight"]
    torch.save(state, tmp_path / "broken.pth")
    failures = []
    for run in range(RUNS):  # tensor parallelism every other run (mesh (2, 1, 2)); a failing load every 3rd and 4th
        failing = run % 4 >= 2
        options = {"tensor_parallel_size": 1 + run % 2}
        if failing:
            options["checkpoint"] = str(tmp_path / "broken.pth")
        scenario = "train_then_fail_to_load" if failing else "train_and_exit"
        result = launch(f"tests.test_clean_exit:{scenario}", options, timeout=120, interpreter_exit=True)
        expected = [1, 1, 1, 1] if failing else [0, 0, 0, 0]
        aborted = [r.global_rank for r in result.ranks if any(text in r.stderr for text in ABORTS)]
        if result.timed_out or result.returncodes != expected or aborted:
            failures.append(
                (run, scenario, result.returncodes, [r.stderr[-800:] for r in result.ranks if r.returncode])
            )
        elif failing:  # one line for the job, on rank 0 (fabric_hsdp/processes/failures.py); the others exit 1 quietly
            said = [line for r in result.ranks for line in r.stderr.splitlines() if "fabric-hsdp: error" in line]
            assert len(said) == 1 and said[0].startswith("fabric-hsdp: error: checkpoint"), said
            assert said[0] in result.ranks[0].stderr, result.ranks[0].stderr[-2000:]
        else:
            assert [value["rank"] for value in result.values] == [0, 1, 2, 3]
    assert not failures, failures


def test_a_rank_that_fails_while_starting_destroys_its_process_group_before_the_interpreter_does(tmp_path):
    """The strategy's exit handler is registered before the process group exists: a rank that fails the rank-layout
    check (it raises once the group exists) leaves no group for the interpreter's teardown to destroy. Left to that
    teardown, a rank aborted once in CI ("terminate called without an active exception", SLURM's task state
    "Aborted", in the ``srun --distribution=cyclic`` test)."""
    result = launch(
        fail_while_starting,
        {"out": str(tmp_path)},
        timeout=120,
        env={"FABRIC_HSDP_DEBUG": "1"},
        interpreter_exit=True,
    )
    assert not result.timed_out and result.returncodes == [1, 1, 1, 1], [r.stderr[-800:] for r in result.ranks]
    assert all("numbered the global ranks across nodes (planted)" in r.stderr for r in result.ranks)
    alive_at_exit = sorted(file.read_text() for file in tmp_path.iterdir())
    assert alive_at_exit == ["False"] * 4, alive_at_exit  # the strategy's handler destroyed it first


# Bodies: what each rank runs when a test above calls launch("<this module>:<body>").
# Scripts that train a step and exit, fail to load, or fail while starting.


def _train_a_step(num_nodes: int, devices: int, tensor_parallel_size: int) -> tuple[Any, Any, torch.Tensor]:
    """Meta-init, set up and train the llama one step: a plain script's first step; the fabric, model and inputs."""
    fabric = make_fabric(
        num_nodes, devices, sharded_modules={layer_class("llama")}, tensor_parallel_size=tensor_parallel_size
    )
    with fabric.init_module(empty_init=True):
        model = build("llama")
    model = fabric.setup_module(model)
    optimizer = fabric.setup_optimizers(torch.optim.AdamW(model.parameters()))
    inputs, targets = batch(2, seed=fabric.global_rank)
    fabric.backward(torch.nn.functional.cross_entropy(model(inputs).flatten(0, 1), targets.flatten()))
    optimizer.step()
    return fabric, model, inputs


def train_and_exit(num_nodes: int, devices: int, tensor_parallel_size: int = 1) -> dict[str, Any]:
    """A script that does nothing special: train a step and let the interpreter exit."""
    fabric, model, inputs = _train_a_step(num_nodes, devices, tensor_parallel_size)
    with torch.no_grad():
        model(inputs)
    return {"rank": fabric.global_rank}


def train_then_fail_to_load(num_nodes: int, devices: int, checkpoint: str, tensor_parallel_size: int = 1) -> None:
    """A script that trains a step, then loads a checkpoint that lacks a weight: every rank must exit 1, cleanly."""
    fabric, model, _ = _train_a_step(num_nodes, devices, tensor_parallel_size)
    fabric.load_raw(checkpoint, model)  # raises CheckpointError on every rank


def fail_while_starting(num_nodes: int, devices: int, out: str) -> None:
    """The rank-layout check fails once the process group exists (as under ``srun --distribution=cyclic``). An exit
    handler registered before the strategy's, so run after it (``atexit`` is last in, first out), records whether the
    process group was still alive then: the interpreter's own teardown of it can abort the rank."""
    import atexit
    from pathlib import Path
    from unittest import mock

    atexit.register(lambda: (Path(out) / str(os.getpid())).write_text(str(dist.is_initialized())))
    planted = ValueError("the launcher numbered the global ranks across nodes (planted)")
    with mock.patch("fabric_hsdp.processes.distributed.check_rank_placement", side_effect=planted):
        make_fabric(num_nodes, devices)
