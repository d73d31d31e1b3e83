"""Shared by ``checkpoint_io.py``, ``load_memory.py`` and ``tp_overhead.py``: launch 2 simulated nodes x 2 CPU ranks,
build the same LLaMA-shaped model under our strategy or Lightning's ``ModelParallelStrategy``, control the page cache,
time the disk.

Ranks are real processes started by ``tests/helpers/launch.py`` (gloo, the environment Lightning's launchers set, a
timeout, every rank ended as soon as one fails). A rank runs ``module:function`` of a benchmark script and returns a
dict of figures to the parent.
"""

from __future__ import annotations

import math
import os
import re
import resource
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parents[1]
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

NUM_NODES = 2
RANKS_PER_NODE = 2
MB = 1e6
MIB = 1 << 20

VARIANT_NAMES = {
    "ours": "HybridFSDPStrategy",
    "lightning": "Lightning MP (FSDP over dp=4)",
    "lightning-hsdp": "Lightning MP (HSDP, 2-D mesh)",
    "lightning-tp": "Lightning MP (dp=2 x tp=2, user parallelize_fn)",
}


class VariantFailed(RuntimeError):
    """A launched variant exited non-zero or ran past its timeout; the message holds every rank's output tail."""


def run_ranks(
    function: str,
    args: dict[str, Any],
    *,
    timeout: float,
    out_dir: Path,
    num_nodes: int = NUM_NODES,
    ranks_per_node: int = RANKS_PER_NODE,
) -> list[dict[str, Any]]:
    """Run ``function`` (``"benchmarks.module:function"``) on ``num_nodes`` x ``ranks_per_node`` ranks (default
    2 x 2); return each rank's dict, by rank."""
    from tests.helpers.launch import launch

    result = launch(
        function, args, num_nodes=num_nodes, ranks_per_node=ranks_per_node, timeout=timeout, out_dir=out_dir
    )
    if result.timed_out or any(code != 0 for code in result.returncodes) or any(v is None for v in result.values):
        details = "\n".join(
            f"--- rank {rank.global_rank} exit {rank.returncode}\n{rank.stdout[-1500:]}\n{rank.stderr[-4000:]}"
            for rank in result.ranks
        )
        reason = f"timed out after {timeout:.0f} s" if result.timed_out else f"exit codes {result.returncodes}"
        raise VariantFailed(f"{function} {args.get('variant', '')} failed ({reason}):\n{details}")
    return result.values


def drop_page_cache() -> bool:
    """``sync; echo 3 > /proc/sys/vm/drop_caches``; False where not permitted (not root, read-only /proc/sys)."""
    subprocess.run(["sync"], check=False, timeout=300)
    try:
        with open("/proc/sys/vm/drop_caches", "w") as file:
            file.write("3\n")
    except OSError:
        return False
    return True


def disk_speed(directory: Path, mib: int = 1024) -> tuple[float, float]:
    """``(write, read)`` bytes/s of ``dd ... bs=1M count=<mib>`` into ``<directory>/ddtest`` with ``oflag=direct``,
    then out of it with ``iflag=direct`` (both bypass the page cache)."""
    target = directory / "ddtest"
    commands = [
        ["dd", "if=/dev/zero", f"of={target}", "bs=1M", f"count={mib}", "oflag=direct"],
        ["dd", f"if={target}", "of=/dev/null", "bs=1M", f"count={mib}", "iflag=direct"],
    ]
    speeds = []
    try:
        for command in commands:
            result = subprocess.run(command, capture_output=True, text=True, timeout=600)
            match = re.search(r"(\d+) bytes .* copied, ([\d.]+) s", result.stderr)
            if result.returncode != 0 or not match:
                raise RuntimeError(f"{' '.join(command)} failed: {result.stderr.strip()}")
            speeds.append(int(match.group(1)) / float(match.group(2)))
    finally:
        target.unlink(missing_ok=True)
    return speeds[0], speeds[1]


def machine_load() -> str:
    """The 1/5/15-minute load averages, to print next to timings (other people share this machine)."""
    one, five, fifteen = os.getloadavg()
    return f"load average {one:.2f} {five:.2f} {fifteen:.2f} on {os.cpu_count()} cores"


def model_config(millions: float) -> Any:
    from examples.tiny_llama import config_for_parameters

    return config_for_parameters(millions)


def tensor_shapes(millions: float) -> dict[str, tuple[int, ...]]:
    """Name -> shape of every tensor in the model's state dict (built on the meta device, no memory)."""
    import torch

    from examples.tiny_llama import Llama

    with torch.device("meta"):
        model = Llama(model_config(millions))
    return {name: tuple(tensor.shape) for name, tensor in model.state_dict().items()}


def describe_config(millions: float) -> str:
    config = model_config(millions)
    shapes = tensor_shapes(millions)
    params = sum(math.prod(shape) for shape in shapes.values())
    largest = max(math.prod(shape) for shape in shapes.values()) * 4
    return (
        f"LLaMA-shaped (examples/tiny_llama.py, config_for_parameters({millions:g})): dim {config.dim},"
        f" {config.n_layers} layers, hidden {config.hidden_dim}, vocab {config.vocab_size};"
        f" {params / 1e6:.1f}M parameters = {params * 4 / MB:.1f} MB fp32 ({params * 4 / MIB:.1f} MiB),"
        f" largest tensor {largest / MIB:.1f} MiB"
    )


# ---------------------------------------------------------------------------------------------------------------
# Inside a rank
# ---------------------------------------------------------------------------------------------------------------


def lightning_parallelize(model: Any, device_mesh: Any) -> Any:
    """``parallelize_fn`` for ``ModelParallelStrategy``: ``fully_shard`` each layer, then the root, over the DP mesh."""
    return _fully_shard_layers_and_root(model, device_mesh["data_parallel"])


def lightning_parallelize_hsdp(model: Any, device_mesh: Any) -> Any:
    """The same over the whole 2-D mesh, which FSDP2 treats as HSDP: replicate over dim 0, shard over dim 1."""
    return _fully_shard_layers_and_root(model, device_mesh)


def llama_tp_plan() -> dict[str, Any]:
    """``examples/tiny_llama.Llama._tp_plan`` translated to torch's styles by hand, as a user would write it for
    ``parallelize_module`` (our ``tensor_parallel_plan="auto"`` does this translation itself)."""
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    return {
        "tok_embeddings": RowwiseParallel(input_layouts=Replicate()),
        "layers.*.attention.wq": ColwiseParallel(),
        "layers.*.attention.wk": ColwiseParallel(),
        "layers.*.attention.wv": ColwiseParallel(),
        "layers.*.attention.wo": RowwiseParallel(),
        "layers.*.feed_forward.w1": ColwiseParallel(),
        "layers.*.feed_forward.w3": ColwiseParallel(),
        "layers.*.feed_forward.w2": RowwiseParallel(),
        "output": ColwiseParallel(output_layouts=Replicate()),
    }


def lightning_parallelize_tp(model: Any, device_mesh: Any) -> Any:
    """A user's ``parallelize_fn`` for ``ModelParallelStrategy`` with tensor parallelism, torchtitan's order:
    ``parallelize_module`` with the LLaMA plan on the tensor-parallel mesh, then ``fully_shard`` each layer and the
    root over the data-parallel mesh."""
    from torch.distributed.tensor.parallel import parallelize_module

    parallelize_module(model, device_mesh["tensor_parallel"], llama_tp_plan())
    return _fully_shard_layers_and_root(model, device_mesh["data_parallel"])


def _fully_shard_layers_and_root(model: Any, mesh: Any) -> Any:
    from torch.distributed.fsdp import fully_shard

    for layer in model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def make_fabric(variant: str, num_nodes: int, devices: int, **strategy_kwargs: Any) -> Any:
    """A launched ``Fabric`` on CPU with our strategy (``"ours"``) or Lightning's ``ModelParallelStrategy``
    (``"lightning"``: FSDP over all ranks; ``"lightning-hsdp"``: its 2-D mesh as HSDP; ``"lightning-tp"``: tensor
    parallelism of 2 inside a node and FSDP across nodes, through :func:`lightning_parallelize_tp`)."""
    import lightning as L
    from lightning.fabric.strategies import ModelParallelStrategy

    from fabric_hsdp import HybridFSDPStrategy

    if variant == "lightning":
        # All ranks data-parallel (plain FSDP over 4 ranks). Lightning's default sizes (data_parallel = nodes,
        # tensor_parallel = devices per node) would leave the TP dim unused: its ranks would hold the same shard
        # without averaging gradients, so "replicas" drift apart and a DCP checkpoint keeps only one of them.
        strategy_kwargs = {"data_parallel_size": num_nodes * devices, "tensor_parallel_size": 1, **strategy_kwargs}
        strategy = ModelParallelStrategy(parallelize_fn=lightning_parallelize, **strategy_kwargs)
    elif variant == "lightning-hsdp":
        # Lightning's own mesh (data_parallel = nodes, tensor_parallel = devices) handed whole to fully_shard: the
        # same topology and shard size as ours, replicas kept in sync by FSDP2's all-reduce over dim 0.
        strategy_kwargs = {"data_parallel_size": num_nodes, "tensor_parallel_size": devices, **strategy_kwargs}
        strategy = ModelParallelStrategy(parallelize_fn=lightning_parallelize_hsdp, **strategy_kwargs)
    elif variant == "lightning-tp":
        # Lightning's mesh (data_parallel, tensor_parallel) = (nodes, 2): tensor-parallel peers on one node, FSDP
        # across the nodes (Lightning has no replicate dim).
        tensor_parallel_size = strategy_kwargs.pop("tensor_parallel_size", 2)
        strategy_kwargs = {
            "data_parallel_size": num_nodes * devices // tensor_parallel_size,
            "tensor_parallel_size": tensor_parallel_size,
            **strategy_kwargs,
        }
        strategy = ModelParallelStrategy(parallelize_fn=lightning_parallelize_tp, **strategy_kwargs)
    else:
        strategy = HybridFSDPStrategy(**strategy_kwargs)
    fabric = L.Fabric(accelerator="cpu", devices=devices, num_nodes=num_nodes, strategy=strategy)
    fabric.launch()
    return fabric


def build_model(fabric: Any, variant: str, millions: float) -> Any:
    """The meta-initialised LLaMA model, set up (sharded, local shards materialised) by the variant's strategy."""
    import torch

    from examples.tiny_llama import Llama, rope_cache

    config = model_config(millions)
    # torch seeds every process differently and reset_parameters() draws each local shard from the rank's own
    # generator; Lightning does not synchronise replicas, so seed by shard index: the replicas of a shard (Lightning
    # HSDP) start identical, as ours are made by the strategy, and a bit-exact check after a reload is meaningful.
    shard_index = fabric.global_rank if variant == "lightning" else fabric.global_rank % fabric.strategy.num_processes
    torch.manual_seed(1000 + shard_index)
    with fabric.init_module(empty_init=True):
        model = Llama(config)
    model = fabric.setup_module(model)
    if variant.startswith("lightning"):
        # Lightning's meta init puts buffers on meta too and to_empty leaves them uninitialised: recompute RoPE so
        # a training step stays finite (ours keeps computed buffers).
        inner = getattr(model, "module", model)
        inner.rope = rope_cache(config.dim // config.n_heads, config.max_seq_len, config.rope_base)
    return model


def release(fabric: Any, modules: list[Any]) -> None:
    """End the rank cleanly for both strategies: drop FSDP2 state, then destroy the process group (see teardown.py)."""
    from fabric_hsdp.processes.teardown import ShardedModuleRegistry

    fabric.barrier()
    registry = ShardedModuleRegistry()
    for module in modules:
        registry.add(getattr(module, "module", module))
    registry.release_and_destroy()


def cpu_seconds() -> float:
    """User + system CPU seconds of this process so far (all its threads)."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def timed(fabric: Any, call: Callable[[], Any]) -> tuple[float, float, Any]:
    """``(wall s, CPU s, value)`` of ``call()`` on this rank, started together with the other ranks (barrier first).

    CPU seconds are far less sensitive than wall seconds to other jobs on a shared machine: a rank that waits for
    the CPU or the disk spends none.
    """
    fabric.barrier()
    cpu = cpu_seconds()
    started = time.perf_counter()
    value = call()
    return time.perf_counter() - started, cpu_seconds() - cpu, value
