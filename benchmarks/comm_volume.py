"""Bytes that cross the node boundary per training step: HSDP (shard within a node) vs FSDP over all ranks vs HSDP
with tensor parallelism (HSDP+TP).

Two simulated nodes are two network namespaces joined by one veth pair; each namespace runs 2 gloo ranks of
``HybridFSDPStrategy`` (``GLOO_SOCKET_IFNAME`` = the namespace's veth, ``MASTER_ADDR`` = node 0's veth address). Ranks
of one node talk over that node's own address, which the kernel routes through loopback, so the veth counters
(``/sys/class/net/<veth>/statistics/{tx,rx}_bytes`` of node 0's end, read by global rank 0) count exactly the
inter-node traffic, and node 0's loopback (``lo`` tx bytes in its namespace) the traffic inside node 0. The report
also shows what ``fabric-hsdp plan`` predicts for the same model (its traffic model with ``backend="gloo"``: between
the nodes summed over both, inside a node per device) and the ratio measured / predicted. Counters are read after a
warm-up step, around a fixed number of steps, between barriers.

Theory (payload bytes, both directions together; ``T`` = the fp32 bytes of the full, padded parameters):

* gloo's ``all_gather_into_tensor`` is a ring over ranks ``0 -> 1 -> 2 -> 3 -> 0``; every rank sends ``(n-1)/n T``
  to its right neighbour, and exactly two ring edges (1 -> 2, 3 -> 0) join the nodes: ``2 (n-1)/n T = 1.5 T``.
* gloo's ``reduce_scatter_tensor`` is an all-reduce of the whole input, then each rank keeps its chunk
  (``ProcessGroupGloo::reduce_scatter_tensor_coalesced``); a ring all-reduce is a ring reduce-scatter plus a ring
  all-gather, so ``2 x 1.5 T = 3 T`` crosses.
* FSDP over 4 ranks per step: forward all-gather of every unit, backward all-gather of every unit resharded after
  forward (FSDP2 keeps the root unit -- embeddings, final norm, output head -- gathered unless
  ``reshard_after_forward=True``), and the gradient reduce-scatter: ``1.5 T + 1.5 T_resharded + 3 T``.
* HSDP (``shard_size="node"``): all-gathers and reduce-scatters stay inside a node; each rank all-reduces its
  gradient shard (``T/2`` here) with the rank of the same shard index on the other node. A ring all-reduce of two
  ranks sends ``2 (2-1)/2 M = M`` each way, so each of the 2 pairs moves ``2 x T/2`` across: ``2 T`` in all.
* HSDP+TP (``shard_size="node"``, ``tensor_parallel_size=2``: mesh ``(replicate, shard, tensor) = (2, 1, 2)``): the
  two ranks of a node are tensor-parallel peers. Everything tensor parallelism exchanges -- the activation
  all-reduces after the row-wise layers (``wo``, ``w2``, the vocabulary-split embedding) in forward and of the
  column-wise layers' input gradients in backward, the all-gather of the logits -- is between those two, inside the
  node. FSDP's ``shard`` dim has size 1: no all-gather or reduce-scatter at all, so nothing of FSDP crosses either.
  What crosses is the all-reduce along ``replicate`` of each rank's gradients, i.e. of its TP slice: half of every
  weight the plan splits (``T_split / 2``) plus all of every weight it leaves whole on both peers (the RMSNorm
  weights, ``T_rep``). Two pairs (TP index 0 and 1), each ``2 x`` its slice: ``2 (T_split/2 + T_rep) x 2 = 2 T +
  2 T_rep``. So HSDP+TP moves HSDP's ``2 T`` plus ``2 T_rep``: HSDP all-reduces the norm gradients once (each rank
  its half), HSDP+TP once per TP peer (each peer its own full copy; the copies are equal, TP's backward all-reduce
  made them so). ``T_rep = (2 L + 1) dim x 4`` bytes is 0.03% of ``T`` for the models here, so HSDP+TP <= HSDP holds
  up to that (and exactly for the split weights).

So HSDP / FSDP = ``2 / (4.5 + 1.5 f)`` with ``f`` the resharded fraction: 1/3 when everything is resharded, more
when the root stays gathered; HSDP+TP / HSDP = ``1 + T_rep / T``. A calibration phase measures the three collectives
on their own first, so the factors above are checked in the same run. Step times are measured with the link
unlimited and rate-limited by ``tc qdisc ... tbf`` on both veth ends; every variant processes the same global batch
(``--batch_size`` sequences per rank x 4 ranks), so HSDP+TP's 2 data-parallel ranks take ``2 x --batch_size`` each.

Inside node 0 (loopback tx bytes, each byte once): HSDP's 2-rank all-gathers move ``T`` each (``(1 + f) T``) and its
reduce-scatter, a gloo all-reduce, ``2 T``: ``(3 + f) T``. FSDP's ring has one edge inside node 0 (0 -> 1):
``0.75 T (1 + f) + 1.5 T``. HSDP+TP moves activations instead of parameters: with ``A`` = the bytes of one
activation ``[b, s, dim]`` of the TP group's micro-batch, ``2 A`` for each of the ``2 L + 1`` forward all-reduces
and the ``5 L + 1`` backward ones (torch's ``ColwiseParallel`` all-reduces the input gradient of each of
``wq``/``wk``/``wv`` and ``w1``/``w3`` on its own, and of ``output``), plus the logits all-gather (``b s V x 4``).

Run as root (network namespaces): ``python benchmarks/comm_volume.py`` (~75 M parameters, a few minutes) or
``--quick``. Without root or ``ip netns`` it prints why and exits 0.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from fnmatch import fnmatch
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parents[1]
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

NUM_NODES = 2
RANKS_PER_NODE = 2
WORLD_SIZE = NUM_NODES * RANKS_PER_NODE
TENSOR_PARALLEL_SIZE = 2
# mode -> (HybridFSDPStrategy's shard_size, tensor_parallel_size)
MODES = {"hsdp": ("node", 1), "fsdp": ("world", 1), "hsdp-tp": ("node", TENSOR_PARALLEL_SIZE)}
MODE_LABELS = {"hsdp": "HSDP", "fsdp": "FSDP", "hsdp-tp": "HSDP+TP"}
MASTER_PORT = 29431
CALIBRATION_BYTES = 8 << 20
# Ethernet (14) + IPv4 (20) + TCP with timestamps (32) bytes per packet the veth counts (a GSO packet counts once)
HEADER_BYTES = 66


# ---------------------------------------------------------------------------------------------------------------
# The two-node network
# ---------------------------------------------------------------------------------------------------------------


class TwoNodeNetwork:
    """Two network namespaces joined by a veth pair, addresses 10.<x>.<y>.1 and .2; removed by ``close()``."""

    def __init__(self) -> None:
        tag = os.getpid() % 100000
        self.namespaces = [f"hsdpbench{tag}n{node}" for node in range(NUM_NODES)]
        self.veths = [f"hsdp{tag}v{node}" for node in range(NUM_NODES)]  # at most 15 characters
        subnet = f"10.{200 + tag % 50}.{tag % 250}"
        self.addresses = [f"{subnet}.{node + 1}" for node in range(NUM_NODES)]
        self._created: list[str] = []

    def open(self) -> None:
        for namespace in self.namespaces:
            _ip("netns", "add", namespace)
            self._created.append(namespace)
        _ip("link", "add", self.veths[0], "type", "veth", "peer", "name", self.veths[1])
        for namespace, veth, address in zip(self.namespaces, self.veths, self.addresses):
            _ip("link", "set", veth, "netns", namespace)
            _ip("-n", namespace, "addr", "add", f"{address}/24", "dev", veth)
            _ip("-n", namespace, "link", "set", "lo", "up")
            _ip("-n", namespace, "link", "set", veth, "up")

    def close(self) -> None:
        # Deleting a namespace deletes the veth end inside it, and with it the pair.
        for namespace in reversed(self._created):
            subprocess.run(["ip", "netns", "del", namespace], capture_output=True, check=False)
        self._created.clear()

    def exec_prefix(self, node: int) -> list[str]:
        return ["ip", "netns", "exec", self.namespaces[node]]

    def check_rate_limit(self, rate: str) -> str | None:
        """Try ``tc ... tbf`` once; return why it cannot be used, or None."""
        if shutil.which("tc") is None:
            return "tc (iproute2) is not installed"
        try:
            for node in range(NUM_NODES):
                subprocess.run(
                    [*self.exec_prefix(node), *tbf_command(self.veths[node], rate)],
                    check=True,
                    capture_output=True,
                    text=True,
                )
                subprocess.run(
                    [*self.exec_prefix(node), "tc", "qdisc", "del", "dev", self.veths[node], "root"],
                    check=True,
                    capture_output=True,
                    text=True,
                )
        except subprocess.CalledProcessError as error:
            return f"`{' '.join(error.cmd)}` failed: {error.stderr.strip()}"
        return None


def _ip(*args: str) -> None:
    result = subprocess.run(["ip", *args], capture_output=True, text=True)
    if result.returncode != 0:
        raise RuntimeError(f"`ip {' '.join(args)}` failed: {result.stderr.strip()}")


def tbf_command(veth: str, rate: str) -> list[str]:
    # burst must exceed the largest (GSO) packet a veth hands over, or tbf drops it.
    return ["tc", "qdisc", "replace", "dev", veth, "root", "tbf", "rate", rate, "burst", "1mb", "latency", "200ms"]


def why_no_namespaces() -> str | None:
    if sys.platform != "linux":
        return f"network namespaces need Linux (this is {sys.platform})"
    if os.geteuid() != 0:
        return "creating network namespaces needs root (run with sudo)"
    if shutil.which("ip") is None:
        return "the `ip` command (iproute2) is not installed"
    probe = f"hsdpbenchprobe{os.getpid() % 100000}"
    result = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True)
    if result.returncode != 0:
        return f"`ip netns add` is not permitted here: {result.stderr.strip()}"
    subprocess.run(["ip", "netns", "del", probe], capture_output=True, check=False)
    return None


# ---------------------------------------------------------------------------------------------------------------
# Theory
# ---------------------------------------------------------------------------------------------------------------


def model_config(quick: bool, millions: float | None) -> Any:
    from examples.tiny_llama import config_for_parameters

    if quick:
        return config_for_parameters(millions or 16, vocab_size=8192)
    return config_for_parameters(millions or 75)


def unit_bytes(config: Any, shard_size: int) -> tuple[int, int]:
    """fp32 bytes of the (root unit, layer units) after FSDP2 pads every dim 0 to a multiple of ``shard_size``."""
    import torch

    from examples.tiny_llama import Llama

    with torch.device("meta"):
        model = Llama(config)
    root = layers = 0
    for name, param in model.named_parameters():
        rows = math.ceil(param.shape[0] / shard_size) * shard_size
        nbytes = rows * math.prod(param.shape[1:]) * param.element_size()
        if name.startswith("layers."):
            layers += nbytes
        else:
            root += nbytes
    return root, layers


def ring_crossing(ranks: int) -> float:
    """Fraction of T a ring all-gather of ``ranks`` ranks (2 nodes, ranks numbered node by node) moves across."""
    return 2 * (ranks - 1) / ranks


def tensor_parallel_bytes(config: Any, tensor_parallel_size: int) -> tuple[int, int]:
    """fp32 bytes of (the weights the example LLaMA's ``_tp_plan`` splits, those it leaves whole) in the full model.

    A rank holds ``split / tensor_parallel_size + replicated`` of them.
    """
    import torch

    from examples.tiny_llama import Llama

    with torch.device("meta"):
        model = Llama(config)
    patterns = [pattern.split(".") for pattern in Llama._tp_plan]
    split = replicated = 0
    for name, param in model.named_parameters():
        parts = name.split(".")[:-1]
        planned = any(len(parts) == len(pattern) and all(map(fnmatch, parts, pattern)) for pattern in patterns)
        nbytes = param.numel() * param.element_size()
        if planned:
            split += nbytes
        else:
            replicated += nbytes
    return split, replicated


def theory_bytes(mode: str, config: Any, reshard_root: bool) -> dict[str, float]:
    """Inter-node payload bytes per step, by collective (see the module docstring)."""
    if mode == "fsdp":
        root, layers = unit_bytes(config, WORLD_SIZE)
        ring = ring_crossing(WORLD_SIZE)
        return {
            "all-gather forward": ring * (root + layers),
            "all-gather backward": ring * (layers + (root if reshard_root else 0)),
            "reduce-scatter (= gloo all-reduce)": 2 * ring * (root + layers),
        }
    if mode == "hsdp-tp":
        split, replicated = tensor_parallel_bytes(config, TENSOR_PARALLEL_SIZE)
        # FSDP's shard dim has size 1 (no padding); one pair per TP index, each all-reduces a rank's TP slice.
        return {
            "all-reduce across nodes, split weights": RANKS_PER_NODE * 2 * split / TENSOR_PARALLEL_SIZE,
            "all-reduce across nodes, replicated weights (norms)": RANKS_PER_NODE * 2 * replicated,
        }
    root, layers = unit_bytes(config, RANKS_PER_NODE)
    shard_bytes = (root + layers) / RANKS_PER_NODE
    # RANKS_PER_NODE pairs; a 2-rank ring all-reduce sends the whole shard each way.
    return {"all-reduce across nodes": RANKS_PER_NODE * 2 * shard_bytes}


def intra_node_theory(mode: str, config: Any, reshard_root: bool, tp_sequences: int, seq_len: int) -> float:
    """Payload bytes per step inside node 0 (each byte once, as loopback's tx counter sees them); see the docstring.

    ``tp_sequences``: the micro-batch of one tensor-parallel group (``hsdp-tp`` only).
    """
    if mode == "hsdp-tp":
        activation = tp_sequences * seq_len * config.dim * 4
        all_reduces = (2 * config.n_layers + 1) + (5 * config.n_layers + 1)
        return all_reduces * 2 * activation + tp_sequences * seq_len * config.vocab_size * 4
    size = WORLD_SIZE if mode == "fsdp" else RANKS_PER_NODE
    root, layers = unit_bytes(config, size)
    gathered = (root + layers) + layers + (root if reshard_root else 0)
    if mode == "fsdp":  # one edge of the 4-rank ring (0 -> 1) lies inside node 0
        return 0.75 * gathered + 1.5 * (root + layers)
    return gathered + 2 * (root + layers)


def planner_traffic(mode: str, config: Any, reshard: bool | None, batch_size: int, seq_len: int) -> Any:
    """``fabric-hsdp plan``'s ``Traffic`` for ``mode`` (gloo): ``inter_node_total`` (all nodes' sends, both
    directions) and ``intra_node_bytes`` (the busiest device's sends inside its node).

    ``batch_size``: sequences per data-parallel rank (the micro-batch of a tensor-parallel group).
    """
    import torch

    from examples.tiny_llama import Llama
    from fabric_hsdp.planning import Training, Workload, model_shape_of_module, traffic_per_step
    from fabric_hsdp.topology import Topology

    shard_size, tensor_parallel_size = MODES[mode]
    with torch.device("meta"):
        shape = model_shape_of_module(Llama(config))
    training = Training("32-true", Workload(batch_size, seq_len), reshard_after_forward=reshard)
    layout = Topology.resolve(shard_size, NUM_NODES, RANKS_PER_NODE, WORLD_SIZE, tensor_parallel_size)
    return traffic_per_step(shape, training, layout, backend="gloo")


def planner_bytes(mode: str, config: Any, reshard: bool | None, batch_size: int, seq_len: int) -> float:
    """Inter-node bytes per step as ``fabric-hsdp plan`` predicts them (gloo, both directions: all nodes' sends)."""
    return planner_traffic(mode, config, reshard, batch_size, seq_len).inter_node_total


# Ranks of node 0 that send to another rank of node 0 (to turn its loopback total into bytes per device): FSDP's
# 4-rank ring has one edge inside node 0 (0 -> 1); HSDP's shard groups and HSDP+TP's tensor groups are the node.
INTRA_NODE_SENDERS = {"hsdp": RANKS_PER_NODE, "fsdp": 1, "hsdp-tp": RANKS_PER_NODE}


CALIBRATION_THEORY = {
    "all_gather_into_tensor (4 ranks)": ring_crossing(WORLD_SIZE),
    "reduce_scatter_tensor (4 ranks)": 2 * ring_crossing(WORLD_SIZE),
    "all_reduce (2 pairs across nodes, T/2 each)": 2.0,
}


# ---------------------------------------------------------------------------------------------------------------
# One rank (runs inside its namespace)
# ---------------------------------------------------------------------------------------------------------------


def veth_bytes(veth: str) -> int:
    statistics = Path("/sys/class/net") / veth / "statistics"
    return int((statistics / "tx_bytes").read_text()) + int((statistics / "rx_bytes").read_text())


def veth_packets(veth: str) -> int:
    statistics = Path("/sys/class/net") / veth / "statistics"
    return int((statistics / "tx_packets").read_text()) + int((statistics / "rx_packets").read_text())


def loopback_bytes() -> int:
    """Bytes this namespace's loopback carried (tx only: each byte sent on ``lo`` is also received on it)."""
    return int(Path("/sys/class/net/lo/statistics/tx_bytes").read_text())


def calibrate(veth: str) -> dict[str, float]:
    """Inter-node bytes of each collective FSDP uses, as a multiple of the full tensor's bytes T."""
    import torch
    import torch.distributed as dist

    rank = dist.get_rank()
    pairs = [dist.new_group([index, index + RANKS_PER_NODE]) for index in range(RANKS_PER_NODE)]
    numel = CALIBRATION_BYTES // 4
    full = torch.ones(numel)
    chunk = torch.ones(numel // WORLD_SIZE)
    half = torch.ones(numel // 2)
    operations = {
        "all_gather_into_tensor (4 ranks)": lambda: dist.all_gather_into_tensor(full, chunk),
        "reduce_scatter_tensor (4 ranks)": lambda: dist.reduce_scatter_tensor(chunk, full),
        "all_reduce (2 pairs across nodes, T/2 each)": lambda: dist.all_reduce(
            half, group=pairs[rank % RANKS_PER_NODE]
        ),
    }
    factors = {}
    for name, operation in operations.items():
        operation()  # connect the pair sockets outside the measurement
        before = read_between_barriers(veth, dist.barrier)
        operation()
        factors[name] = (read_between_barriers(veth, dist.barrier) - before) / CALIBRATION_BYTES
    return factors


def read_between_barriers(veth: str, barrier: Any) -> int:
    """Read the veth counters once every rank is idle, and let no rank go on until they are read.

    A single barrier is not enough: ranks leave it at different moments, and one that leaves early would start
    sending before the slowest one reads the counters.
    """
    return counters_between_barriers(veth, barrier)[0]


def counters_between_barriers(veth: str, barrier: Any) -> tuple[int, int, int]:
    """``(veth tx + rx bytes, loopback tx bytes, veth tx + rx packets)`` of this namespace, read as
    :func:`read_between_barriers` does."""
    barrier()
    counts = veth_bytes(veth), loopback_bytes(), veth_packets(veth)
    barrier()
    return counts


def run_rank(spec: dict[str, Any]) -> None:
    import warnings
    from datetime import timedelta

    import lightning as L
    import torch

    from examples.tiny_llama import Llama, LlamaConfig, loss_fn
    from fabric_hsdp import HybridFSDPStrategy

    warnings.filterwarnings("ignore", category=FutureWarning)
    torch.set_num_threads(1)
    veth = os.environ["GLOO_SOCKET_IFNAME"]
    strategy = HybridFSDPStrategy(
        shard_size=spec["shard_size"],
        tensor_parallel_size=spec.get("tensor_parallel_size", 1),
        reshard_after_forward=spec["reshard_after_forward"],
        timeout=timedelta(seconds=spec["collective_timeout"]),
    )
    fabric = L.Fabric(accelerator="cpu", devices=RANKS_PER_NODE, num_nodes=NUM_NODES, strategy=strategy)
    fabric.launch()
    report: dict[str, Any] = {"mesh": str(strategy.topology.mesh_shape)}
    if spec["calibrate"]:
        report["calibration"] = calibrate(veth)

    config = LlamaConfig(**spec["config"])
    with fabric.init_module(empty_init=True):
        model = Llama(config)
    model = fabric.setup_module(model)
    optimizer = fabric.setup_optimizers(torch.optim.AdamW(model.parameters(), lr=1e-4))
    # Tensor-parallel peers compute on the same micro-batch: seed by data-parallel rank (= global rank without TP).
    generator = torch.Generator().manual_seed(strategy.topology.data_parallel_rank(fabric.global_rank))
    batch, seq = spec["batch_size"], spec["seq_len"]

    def train_step() -> None:
        tokens = torch.randint(0, config.vocab_size, (batch, seq + 1), generator=generator)
        loss = loss_fn(model(tokens[:, :-1]), tokens[:, 1:])
        fabric.backward(loss)
        optimizer.step()
        optimizer.zero_grad()

    def measure(steps: int) -> tuple[float, float, float, float]:
        before, started = counters_between_barriers(veth, fabric.barrier), time.perf_counter()
        for _ in range(steps):
            train_step()
        after = counters_between_barriers(veth, fabric.barrier)
        seconds = (time.perf_counter() - started) / steps
        veth_bytes_, loopback, packets = ((a - b) / steps for a, b in zip(after, before))
        return veth_bytes_, seconds, loopback, packets

    train_step()  # warm-up: FSDP2's lazy init, gloo pair connections, allocator
    measured = measure(spec["steps"])
    report["bytes_per_step"], report["seconds_per_step"] = measured[:2]
    report["intra_node_bytes_per_step"], report["packets_per_step"] = measured[2:]
    if spec["rate"]:
        if fabric.local_rank == 0:
            subprocess.run(tbf_command(veth, spec["rate"]), check=True, capture_output=True)
        train_step()  # let the queue settle at the limited rate
        limited = measure(spec["limited_steps"])
        report["limited_bytes_per_step"], report["limited_seconds_per_step"] = limited[:2]
        fabric.barrier()
        if fabric.local_rank == 0:
            subprocess.run(["tc", "qdisc", "del", "dev", veth, "root"], check=False, capture_output=True)
    if fabric.global_rank == 0:
        Path(spec["result_file"]).write_text(json.dumps(report))
    fabric.barrier()


# ---------------------------------------------------------------------------------------------------------------
# The driver
# ---------------------------------------------------------------------------------------------------------------


def launch(network: TwoNodeNetwork, spec: dict[str, Any], timeout: float, log_dir: Path) -> dict[str, Any]:
    """Start the 4 ranks in their namespaces, wait (with a timeout), return rank 0's report."""
    processes = []
    spec_json = json.dumps(spec)
    for node in range(NUM_NODES):
        for local_rank in range(RANKS_PER_NODE):
            env = dict(
                os.environ,
                MASTER_ADDR=network.addresses[0],
                MASTER_PORT=str(MASTER_PORT),
                NODE_RANK=str(node),
                LOCAL_RANK=str(local_rank),
                WORLD_SIZE=str(WORLD_SIZE),
                GLOO_SOCKET_IFNAME=network.veths[node],
                OMP_NUM_THREADS="1",
                PYTHONUNBUFFERED="1",
                PYTHONPATH=os.pathsep.join([str(REPO_ROOT), os.environ.get("PYTHONPATH", "")]),
            )
            global_rank = node * RANKS_PER_NODE + local_rank
            log = open(log_dir / f"{spec['mode']}-rank{global_rank}.log", "w")  # noqa: SIM115
            command = [*network.exec_prefix(node), sys.executable, str(Path(__file__).resolve()), "--rank", spec_json]
            processes.append((subprocess.Popen(command, env=env, stdout=log, stderr=subprocess.STDOUT), log))
    deadline = time.monotonic() + timeout
    try:
        while any(process.poll() is None for process, _ in processes):
            failed = [process for process, _ in processes if process.poll() not in (None, 0)]
            if failed or time.monotonic() > deadline:
                break
            time.sleep(0.2)
    finally:
        for process, log in processes:
            if process.poll() is None:
                process.kill()
            process.wait()
            log.close()
    codes = [process.returncode for process, _ in processes]
    result_file = Path(spec["result_file"])
    if any(code != 0 for code in codes) or not result_file.exists():
        tail = (log_dir / f"{spec['mode']}-rank0.log").read_text()[-3000:]
        reason = "timed out" if time.monotonic() > deadline else f"exit codes {codes}"
        raise RuntimeError(f"{spec['mode']} run failed ({reason}); logs in {log_dir}. rank 0:\n{tail}")
    return json.loads(result_file.read_text())


def _mb(nbytes: float) -> str:
    return f"{nbytes / 1e6:,.1f} MB"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="~16 M parameters, fewer steps (a smoke test)")
    parser.add_argument("--params", type=float, default=None, help="model size in millions (default 75; quick 16)")
    parser.add_argument("--steps", type=int, default=None, help="measured steps, unlimited link (default 3; quick 2)")
    parser.add_argument("--limited_steps", type=int, default=None, help="measured steps at --rate (default 2; quick 1)")
    parser.add_argument("--rate", default="1gbit", help="tc tbf rate for the timing run; '' to skip it")
    parser.add_argument(
        "--reshard_after_forward",
        choices=["auto", "true", "false"],
        default="auto",
        help="HybridFSDPStrategy(reshard_after_forward=...): auto = FSDP2's default (root unit stays gathered)",
    )
    parser.add_argument(
        "--batch_size",
        type=int,
        default=1,
        help="sequences per rank; HSDP+TP's data-parallel ranks take 2x as many, so every variant's global batch"
        " is the same",
    )
    parser.add_argument("--seq_len", type=int, default=32)
    parser.add_argument(
        "--modes",
        default=",".join(MODES),
        help=f"comma-separated, run in this order, from {', '.join(MODES)} (default: all; hsdp,fsdp is what the"
        " script measured before HSDP+TP existed)",
    )
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds per launch before it is killed")
    parser.add_argument("--json", type=Path, default=None, help="also write the figures to this JSON file")
    parser.add_argument("--rank", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.rank is not None:
        run_rank(json.loads(args.rank))
        return 0
    modes = [mode.strip() for mode in args.modes.split(",") if mode.strip()]
    unknown = [mode for mode in modes if mode not in MODES]
    if unknown or not modes:
        parser.error(f"--modes {args.modes!r}: choose from {', '.join(MODES)}")

    reason = why_no_namespaces()
    if reason is not None:
        print(f"comm_volume: skipped: {reason}.")
        return 0
    steps = args.steps or (2 if args.quick else 3)
    limited_steps = args.limited_steps or (1 if args.quick else 2)
    reshard = {"auto": None, "true": True, "false": False}[args.reshard_after_forward]
    config = model_config(args.quick, args.params)
    import torch

    from examples.tiny_llama import Llama

    with torch.device("meta"):
        parameters = Llama(config).num_parameters()
    print(
        f"model: LLaMA-style, {parameters / 1e6:.1f} M parameters (dim {config.dim}, {config.n_layers} layers,"
        f" vocab {config.vocab_size}), fp32, batch {args.batch_size} x {args.seq_len} tokens per rank;"
        f" {NUM_NODES} nodes (network namespaces) x {RANKS_PER_NODE} gloo ranks; reshard_after_forward="
        f"{args.reshard_after_forward}"
    )
    if "hsdp-tp" in modes:
        print(
            f"HSDP+TP: tensor_parallel_size={TENSOR_PARALLEL_SIZE} (plan: the model's _tp_plan); each of its"
            f" {WORLD_SIZE // TENSOR_PARALLEL_SIZE} data-parallel ranks takes"
            f" {args.batch_size * TENSOR_PARALLEL_SIZE} x {args.seq_len} tokens (the same global batch)"
        )

    # Ctrl-C and SIGTERM end in the finally below, which removes the namespaces.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    network = TwoNodeNetwork()
    log_dir = Path(tempfile.mkdtemp(prefix="hsdp-comm-volume-"))
    results: dict[str, dict[str, Any]] = {}
    started = time.monotonic()
    try:
        network.open()
        rate = args.rate or None
        if rate:
            problem = network.check_rate_limit(rate)
            if problem:
                print(f"rate-limited timing skipped: {problem}")
                rate = None
        print(
            f"network: {network.namespaces[0]} ({network.veths[0]} {network.addresses[0]}) <-veth->"
            f" {network.namespaces[1]} ({network.veths[1]} {network.addresses[1]}); logs in {log_dir}"
        )
        for mode in modes:
            shard_size, tensor_parallel_size = MODES[mode]
            spec = {
                "mode": mode,
                "shard_size": shard_size,
                "tensor_parallel_size": tensor_parallel_size,
                "reshard_after_forward": reshard,
                "config": vars(config),
                "batch_size": args.batch_size * tensor_parallel_size,
                "seq_len": args.seq_len,
                "steps": steps,
                "limited_steps": limited_steps,
                "rate": rate,
                "calibrate": mode == modes[0],
                "collective_timeout": args.timeout,
                "result_file": str(log_dir / f"{mode}.json"),
            }
            launch_started, load_before = time.monotonic(), os.getloadavg()[0]
            results[mode] = launch(network, spec, args.timeout, log_dir)
            results[mode]["load_average"] = [load_before, os.getloadavg()[0]]
            print(
                f"{mode}: done in {time.monotonic() - launch_started:.0f} s (mesh {results[mode]['mesh']}; 1-minute"
                f" load average {load_before:.1f} -> {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores)"
            )
    except RuntimeError as error:
        print(f"comm_volume: error: {error}", file=sys.stderr)
        return 1
    finally:
        network.close()
    report(results, config, reshard, rate, steps, limited_steps, args.json, args.batch_size, args.seq_len)
    print(f"total {time.monotonic() - started:.0f} s")
    return 0


def report(
    results: dict[str, dict[str, Any]],
    config: Any,
    reshard: bool | None,
    rate: str | None,
    steps: int,
    limited_steps: int,
    json_path: Path | None,
    batch_size: int = 1,
    seq_len: int = 32,
) -> None:
    calibration = next((result["calibration"] for result in results.values() if "calibration" in result), {})
    print("\ncalibration: inter-node bytes of one collective, in units of the full tensor T (8 MiB)")
    print(f"  {'collective':<46} {'measured':>9} {'theory':>7}")
    for name, measured in calibration.items():
        print(f"  {name:<46} {measured:>9.3f} {CALIBRATION_THEORY[name]:>7.3f}")

    theories = {mode: theory_bytes(mode, config, reshard_root=reshard is True) for mode in results}
    intra_theories = {
        mode: intra_node_theory(mode, config, reshard is True, batch_size * TENSOR_PARALLEL_SIZE, seq_len)
        for mode in results
    }
    planned_traffic = {
        mode: planner_traffic(mode, config, reshard, batch_size * MODES[mode][1], seq_len) for mode in results
    }
    planned = {mode: traffic.inter_node_total for mode, traffic in planned_traffic.items()}
    width = max(6, *(len(mode) for mode in results))
    print(f"\nper training step ({steps} steps measured after a warm-up step; bytes = veth tx + rx)")
    header = f"  {'':<{width}} {'measured':>12} {'theory':>12} {'meas/theory':>11} {'planner':>12} {'meas/planner':>12}"
    header += f" {'s/step':>8}"
    if rate:
        header += f" {'s/step @' + rate:>14}"
    print(header)
    for mode, result in results.items():
        theory = sum(theories[mode].values())
        line = (
            f"  {mode:<{width}} {_mb(result['bytes_per_step']):>12} {_mb(theory):>12}"
            f" {result['bytes_per_step'] / theory:>11.3f} {_mb(planned[mode]):>12}"
            f" {result['bytes_per_step'] / planned[mode]:>12.3f} {result['seconds_per_step']:>8.2f}"
        )
        if rate:
            line += f" {result['limited_seconds_per_step']:>14.2f}"
        print(line)
    for mode, parts in theories.items():
        print(f"  theory {mode}: " + ", ".join(f"{name} {_mb(value)}" for name, value in parts.items()))

    print(
        "\ninside node 0 per step (loopback tx bytes: the traffic between the two ranks of node 0; per device: over the"
        " ranks of node 0 that send inside it, what the planner's intra-node figure counts)"
    )
    print(
        f"  {'':<{width}} {'measured':>12} {'theory':>12} {'meas/theory':>11} {'per device':>12} {'planner':>12}"
        f" {'meas/planner':>12}"
    )
    for mode, result in results.items():
        measured = result.get("intra_node_bytes_per_step", float("nan"))
        per_device = measured / INTRA_NODE_SENDERS[mode]
        predicted = planned_traffic[mode].intra_node_bytes
        print(
            f"  {mode:<{width}} {_mb(measured):>12} {_mb(intra_theories[mode]):>12}"
            f" {measured / intra_theories[mode]:>11.3f} {_mb(per_device):>12} {_mb(predicted):>12}"
            f" {per_device / predicted if predicted else float('nan'):>12.3f}"
        )

    summary: dict[str, Any] = {}
    if "hsdp" in results and "fsdp" in results:
        measured_ratio = results["hsdp"]["bytes_per_step"] / results["fsdp"]["bytes_per_step"]
        theory_ratio = sum(theories["hsdp"].values()) / sum(theories["fsdp"].values())
        summary.update(measured_ratio=measured_ratio, theory_ratio=theory_ratio)
        target = 1 / (1.5 * RANKS_PER_NODE)
        verdict = "met" if measured_ratio <= target else f"MISSED by {measured_ratio / target - 1:.1%}"
        print(
            f"\nHSDP / FSDP inter-node bytes: measured {measured_ratio:.3f}, theory {theory_ratio:.3f};"
            f" target <= {target:.3f} = 1 / (1.5 x {RANKS_PER_NODE} ranks per node): {verdict}"
        )
        if theory_ratio > target:
            print(
                "  (with gloo's ring collectives the theory itself is 2 / (4.5 + 1.5 f), f = fraction of T re-gathered"
                " in backward: it reaches 1/3 only with reshard_after_forward=true)"
            )
    if "hsdp-tp" in results and "hsdp" in results:
        tp_measured = results["hsdp-tp"]["bytes_per_step"] / results["hsdp"]["bytes_per_step"]
        tp_theory = sum(theories["hsdp-tp"].values()) / sum(theories["hsdp"].values())
        summary.update(tp_measured_ratio=tp_measured, tp_theory_ratio=tp_theory)
        norms = theories["hsdp-tp"]["all-reduce across nodes, replicated weights (norms)"] / 2
        strict = "holds" if tp_measured <= 1 else f"not strictly: +{tp_measured - 1:.2%}"
        agrees = "within" if abs(tp_measured - tp_theory) <= 0.005 else "OUTSIDE"
        print(
            f"HSDP+TP / HSDP inter-node bytes: measured {tp_measured:.4f}, theory {tp_theory:.4f} ({agrees} 0.5%);"
            f" HSDP+TP <= HSDP: {strict}. Theory: the split weights cross exactly as under HSDP; the norm weights,"
            f" which TP leaves whole on both peers, are all-reduced by each peer where HSDP shards them:"
            f" +{_mb(norms)} per step"
        )
        if all("packets_per_step" in results[mode] for mode in ("hsdp", "hsdp-tp")):
            payload = {
                mode: results[mode]["bytes_per_step"] - HEADER_BYTES * results[mode]["packets_per_step"]
                for mode in ("hsdp", "hsdp-tp")
            }
            summary.update(tp_payload_ratio=payload["hsdp-tp"] / payload["hsdp"])
            print(
                f"  less {HEADER_BYTES} B of Ethernet/IP/TCP headers per packet counted (ACKs are all header):"
                f" HSDP {_mb(payload['hsdp'])} ({results['hsdp']['packets_per_step']:,.0f} packets),"
                f" HSDP+TP {_mb(payload['hsdp-tp'])} ({results['hsdp-tp']['packets_per_step']:,.0f} packets):"
                f" {payload['hsdp-tp'] / payload['hsdp']:.4f}"
            )
    if "hsdp-tp" in results and "fsdp" in results:
        ratio = results["hsdp-tp"]["bytes_per_step"] / results["fsdp"]["bytes_per_step"]
        theory = sum(theories["hsdp-tp"].values()) / sum(theories["fsdp"].values())
        summary.update(tp_fsdp_measured_ratio=ratio, tp_fsdp_theory_ratio=theory)
        print(f"HSDP+TP / FSDP inter-node bytes: measured {ratio:.3f}, theory {theory:.3f}")
    for mode, result in results.items():
        deviation = result["bytes_per_step"] / sum(theories[mode].values()) - 1
        print(f"  {mode} measured vs theory: {deviation:+.1%} ({'within' if abs(deviation) <= 0.1 else 'OUTSIDE'} 10%)")
    if "hsdp" in results and "fsdp" in results and rate:
        speedup = results["fsdp"]["limited_seconds_per_step"] / results["hsdp"]["limited_seconds_per_step"]
        unlimited = results["fsdp"]["seconds_per_step"] / results["hsdp"]["seconds_per_step"]
        print(f"  step time FSDP / HSDP: {unlimited:.2f}x unlimited, {speedup:.2f}x at {rate} ({limited_steps} steps)")
    if "hsdp-tp" in results and rate:
        for other in ("hsdp", "fsdp"):
            if other in results:
                unlimited = results[other]["seconds_per_step"] / results["hsdp-tp"]["seconds_per_step"]
                limited = results[other]["limited_seconds_per_step"] / results["hsdp-tp"]["limited_seconds_per_step"]
                print(
                    f"  step time {MODE_LABELS[other]} / HSDP+TP: {unlimited:.2f}x unlimited, {limited:.2f}x at {rate}"
                    f" ({limited_steps} steps)"
                )
    loads = {mode: result["load_average"] for mode, result in results.items() if "load_average" in result}
    if loads:
        print(
            "  load average (1 min) at the start and end of each launch: "
            + ", ".join(f"{mode} {start:.1f}/{end:.1f}" for mode, (start, end) in loads.items())
            + f" on {os.cpu_count()} cores"
        )
    if json_path is not None:
        json_path.write_text(
            json.dumps(
                {
                    "results": results,
                    "theory": theories,
                    "planner": planned,
                    "intra_node_theory": intra_theories,
                    "planner_intra_node_per_device": {m: t.intra_node_bytes for m, t in planned_traffic.items()},
                    **summary,
                },
                indent=2,
            )
        )


if __name__ == "__main__":
    sys.exit(main())
