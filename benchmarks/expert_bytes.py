"""Bytes each rank sends per training step, by collective: a mixture-of-experts model under FSDP only
(``expert_parallel_size=1``) vs expert parallelism (``expert_parallel_size=N``), counted and against the planner.

A Qwen3-MoE made locally (hidden 64, 2 layers, 8 experts of intermediate 64, top-2, vocab 256; fp32; the experts are
88 % of the parameters) trains on 2 simulated nodes x 2 gloo ranks (``shard_size="node"``, mesh ``(2, 2)``) and on
1 node x 4 ranks (``shard_size=4``). Each layer's experts are an FSDP unit of their own in every variant (under EP the
strategy makes them so; at EP 1 ``sharded_modules`` names the experts class beside the layer class), so their
collectives are calls of their own.

Counting: a ``TorchDispatchMode`` on every rank sees each collective op (``c10d`` and the functional
``_c10d_functional`` ones, forward and backward) with its tensors, group and split sizes, and charges the bytes this
rank sends under gloo's algorithms, the backend model ``benchmarks/comm_volume.py`` measures on the wire: an
all-gather of output ``O`` over ``S`` ranks sends ``(S-1)/S O``; gloo's reduce-scatter is an all-reduce of the whole
input ``I`` (``ProcessGroupGloo::reduce_scatter_tensor_coalesced``), ``2 (S-1)/S I``, as is an all-reduce; an
all-to-all sends the rows of its input splits addressed to other ranks (its own rows stay). FSDP collectives are
charged to the experts when the FSDP unit issuing them (the ``FSDPParamGroup`` unsharding or reducing) holds an experts
module, to "rest" otherwise.

Expected, per MoE layer and micro-batch, per rank (the first and third are the planner's, :func:`planner_bytes`;
``P_e`` the layer's expert parameters, ``b_p``/``b_r`` bytes per
parameter of the all-gathers and of the gradient reduction, ``S`` the shard group, ``N`` the expert-parallel size,
``e = S / N`` the expert shard group, ``R`` the replicas, ``T`` tokens per rank, ``k`` experts per token, ``h`` the
hidden size, ``b_a`` bytes per activation):

* experts' all-gathers and reduce-scatter: ``(e-1)/e (P_e/N) (2 b_p + g b_r)``, ``g = 2`` on gloo (1 on NCCL); FSDP
  only is ``N = 1``, ``e = S``;
* the experts' gradient all-reduce over ``replicate`` (HSDP): ``2 (R-1)/R (P_e/S) b_r``, the same with or without EP
  (each rank reduces ``P_e / S`` either way);
* token all-to-all: ``n T k h b_a (N-1)/N`` with ``n = 4`` (dispatch and combine, forward and backward), exact when
  the routing is uniform (``--routing uniform``, the default: token ``t`` goes to experts ``t k + j mod E``); with the
  model's own routing (``--routing model``) the rows a rank sends to others are counted and shown beside it;
* the counts exchange: ``(N-1)/N E`` int64 per layer (forward only).

Run: ``python benchmarks/expert_bytes.py [--routing model] [--steps 2]`` (about a minute per variant here).
"""

from __future__ import annotations

import argparse
import math
import sys
import tempfile
import time
from collections import defaultdict
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parents[1]
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

import torch  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402

BATCH, SEQ = 2, 16
EXPERTS, TOP_K, HIDDEN, EXPERT_INTERMEDIATE, LAYERS = 8, 2, 64, 64, 2
FP32 = 4
COUNT_BYTES = 8  # the counts exchange sends int64
TOLERANCE = 0.05


@dataclass(frozen=True)
class Case:
    """A cluster and an expert-parallel size: ``num_nodes`` x ``ranks_per_node`` CPU ranks, ``shard_size``."""

    num_nodes: int
    ranks_per_node: int
    shard_size: int
    expert_parallel_size: int

    @property
    def world_size(self) -> int:
        return self.num_nodes * self.ranks_per_node

    @property
    def replicate_size(self) -> int:
        return self.world_size // self.shard_size

    @property
    def label(self) -> str:
        return f"{self.num_nodes}x{self.ranks_per_node} S={self.shard_size} EP {self.expert_parallel_size}"


CASES = (
    Case(2, 2, 2, 1),
    Case(2, 2, 2, 2),
    Case(1, 4, 4, 1),
    Case(1, 4, 4, 2),
    Case(1, 4, 4, 4),
)


# ---------------------------------------------------------------------------------------------------------------
# The formula
# ---------------------------------------------------------------------------------------------------------------


def expert_replicate_bytes(expert_params: int, shard_size: int, replicate_size: int, grad_bytes: int) -> float:
    """Bytes a rank sends per MoE layer for the all-reduce of its experts' gradient shard over ``replicate`` (HSDP):
    ``2 (R-1)/R (P_e/S) b_r``, whatever the expert-parallel size."""
    return 2 * (replicate_size - 1) / replicate_size * expert_params / shard_size * grad_bytes


def count_exchange_bytes(experts: int, expert_parallel_size: int) -> float:
    """Bytes a rank sends per MoE layer in the exchange of the per-expert row counts (int64, forward only)."""
    n = expert_parallel_size
    return (n - 1) / n * experts * COUNT_BYTES


def planner_bytes(case: Case) -> dict[str, float]:
    """The planner's bytes per rank and MoE layer (``fabric_hsdp.planning.traffic_per_step`` on gloo, at this
    model, micro-batch and layout): the experts' share of the shard and ``expert_shard`` dims (the shard dim less
    its bytes at ``N = S``, where it carries the dense units only) and the ``expert`` dim's all-to-alls."""
    from transformers import AutoModelForCausalLM

    from fabric_hsdp.planning import Training, Workload, traffic_per_step
    from fabric_hsdp.planning.model import model_shape_of_module
    from fabric_hsdp.topology import EXPERT_DIM, EXPERT_SHARD_DIM, SHARD_DIM, Topology

    with torch.device("meta"):
        model = model_shape_of_module(AutoModelForCausalLM.from_config(model_config()))
    training = Training("32-true", Workload(BATCH, SEQ))

    def rank_bytes(expert_parallel_size: int, dim: str) -> float:
        layout = Topology.resolve(
            case.shard_size, case.num_nodes, case.ranks_per_node, case.world_size, 1, expert_parallel_size
        )
        traffic = traffic_per_step(model, training, layout, "gloo")
        # a rank's share: within its node, or of its node's bytes to other nodes
        return (traffic.intra_by_dim[dim] or traffic.by_dim[dim] / case.ranks_per_node) / model.dims.expert_layers

    size = case.expert_parallel_size
    gathers = rank_bytes(size, SHARD_DIM) - rank_bytes(case.shard_size, SHARD_DIM) + rank_bytes(size, EXPERT_SHARD_DIM)
    return {"experts all-gather + reduce-scatter": gathers, "token all-to-all": rank_bytes(size, EXPERT_DIM)}


def formula(case: Case, expert_params: int) -> dict[str, float]:
    """The expected bytes per rank, per MoE layer and micro-batch, by part (fp32, gloo): the planner's for the
    experts' gathers and the tokens, the hand formulas above for the replicas' all-reduce and the counts."""
    return {
        **planner_bytes(case),
        "experts replicate all-reduce": expert_replicate_bytes(
            expert_params, case.shard_size, case.replicate_size, FP32
        ),
        "count exchange": count_exchange_bytes(EXPERTS, case.expert_parallel_size),
    }


# ---------------------------------------------------------------------------------------------------------------
# Counting (inside each rank)
# ---------------------------------------------------------------------------------------------------------------


def model_config() -> Any:
    from tests.helpers.moe import config

    moe_config = config("qwen3_moe")
    moe_config.num_experts = EXPERTS
    moe_config.num_experts_per_tok = TOP_K
    moe_config.moe_intermediate_size = EXPERT_INTERMEDIATE
    moe_config.num_hidden_layers = LAYERS
    moe_config.hidden_size = HIDDEN
    return moe_config


def expert_parameters_per_layer() -> int:
    from transformers import AutoModelForCausalLM

    from fabric_hsdp.models.experts import expert_modules

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(model_config())
    (_, experts), *_ = expert_modules(model)
    return sum(p.numel() for p in experts.parameters())


def _group_of(arg: Any) -> Any:
    """The process group of a collective op's argument: a ``ProcessGroup`` (c10d ops) or its name (functional)."""
    import torch.distributed as dist

    if isinstance(arg, str):
        from torch.distributed.distributed_c10d import _resolve_process_group

        return _resolve_process_group(arg)
    return arg if isinstance(arg, dist.ProcessGroup) else dist.ProcessGroup.unbox(arg)


def _nbytes(tensors: Any) -> int:
    if isinstance(tensors, torch.Tensor):
        return tensors.numel() * tensors.element_size()
    return sum(_nbytes(t) for t in tensors)


def _all_to_all_sent(tensor: torch.Tensor, input_splits: list[int] | None, group: Any) -> int:
    """Bytes of the rows of ``tensor`` addressed to other ranks of ``group``."""
    size, rank = group.size(), group.rank()
    if not input_splits:
        return tensor.numel() * tensor.element_size() * (size - 1) // size
    row_bytes = tensor[0].numel() * tensor.element_size() if tensor.shape[0] else 0
    return sum(rows for peer, rows in enumerate(input_splits) if peer != rank) * row_bytes


class CollectiveBytes(TorchDispatchMode):
    """Bytes this rank sends per collective (gloo's algorithms; see the module docstring), by ``(part, collective)``;
    ``part`` is what :meth:`charged_to` says at the time of the call."""

    def __init__(self) -> None:
        super().__init__()
        self.sent: dict[tuple[str, str], float] = defaultdict(float)
        self.part = "rest"

    @contextmanager
    def charged_to(self, part: str) -> Iterator[None]:
        previous, self.part = self.part, part
        try:
            yield
        finally:
            self.part = previous

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        namespace, name = func.namespace, func.overloadpacket.__name__
        # not _c10d_functional_autograd: its kernels call the _c10d_functional op, seen here on its own
        if namespace in ("c10d", "_c10d_functional"):
            self._count(namespace, name.rstrip("_"), args)
        return func(*args, **kwargs)

    def _count(self, namespace: str, name: str, args: Any) -> None:
        functional = namespace != "c10d"
        if name in ("_allgather_base", "all_gather_into_tensor"):
            # c10d: (output, input, group, ...); functional: (input, group_size, group_name)
            group = _group_of(args[2])
            size = group.size()
            output = _nbytes(args[0]) if not functional else _nbytes(args[0]) * size
            self.sent[(self.part, "all-gather")] += (size - 1) / size * output
        elif name in ("_reduce_scatter_base", "reduce_scatter_tensor"):
            # c10d: (output, input, group, ...); functional: (input, op, group_size, group_name)
            group = _group_of(args[2] if not functional else args[3])
            size = group.size()
            whole = _nbytes(args[1] if not functional else args[0])
            self.sent[(self.part, "reduce-scatter (= gloo all-reduce)")] += 2 * (size - 1) / size * whole
        elif name in ("allreduce", "all_reduce"):
            # c10d: (tensors, group, ...); functional: (input, op, group_name)
            group = _group_of(args[1] if not functional else args[2])
            size = group.size()
            self.sent[(self.part, "all-reduce")] += 2 * (size - 1) / size * _nbytes(args[0])
        elif name in ("alltoall_base", "all_to_all_single"):
            # c10d: (output, input, group, output_splits, input_splits, ...);
            # functional: (input, output_splits, input_splits, group_name)
            if functional:
                tensor, input_splits, group = args[0], args[2], _group_of(args[3])
            else:
                tensor, input_splits, group = args[1], args[4], _group_of(args[2])
            kind = "count exchange" if not tensor.is_floating_point() else "token all-to-all"
            self.sent[(kind, "all-to-all")] += _all_to_all_sent(tensor, input_splits, group)
        elif name not in ("wait_tensor", "barrier", "_wrap_tensor_autograd"):
            self.sent[(self.part, name)] += 0.0  # seen, not modelled: listed in the table with 0 bytes


@contextmanager
def charge_fsdp_units(counter: CollectiveBytes, expert_module_ids: set[int]) -> Iterator[None]:
    """While inside, the collectives an FSDP unit issues (unsharding, reducing its gradients) are charged to the
    experts if the unit holds an experts module. FSDP2's private ``FSDPParamGroup``: a benchmark's probe, not
    library code."""
    from torch.distributed.fsdp._fully_shard._fsdp_param_group import FSDPParamGroup

    originals = {name: getattr(FSDPParamGroup, name) for name in ("unshard", "post_backward")}

    def wrap(original: Any) -> Any:
        def charged(self: Any, *args: Any, **kwargs: Any) -> Any:
            part = "experts" if any(id(module) in expert_module_ids for module in self.modules) else "rest"
            with counter.charged_to(part):
                return original(self, *args, **kwargs)

        return charged

    for name, original in originals.items():
        setattr(FSDPParamGroup, name, wrap(original))
    try:
        yield
    finally:
        for name, original in originals.items():
            setattr(FSDPParamGroup, name, original)


def uniform_routing(model: torch.nn.Module) -> None:
    """Route token ``t`` of each layer to experts ``t k + j mod E`` (its weights stay the router's top-k values)."""

    def route(module: torch.nn.Module, inputs: Any, output: Any) -> Any:
        logits, scores, indices = output
        tokens = torch.arange(indices.shape[0], device=indices.device).unsqueeze(-1)
        choices = torch.arange(indices.shape[1], device=indices.device)
        return logits, scores, (tokens * indices.shape[1] + choices) % module.num_experts

    for name, module in model.named_modules():
        if name.endswith("mlp.gate"):
            module.register_forward_hook(route)


def count_rank(
    num_nodes: int, devices: int, shard_size: int, expert_parallel_size: int, steps: int, routing: str
) -> dict[str, Any]:
    """One rank: a warm-up step, then ``steps`` steps counted; bytes per step by ``"part/collective"``."""
    from transformers import AutoModelForCausalLM
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeDecoderLayer, Qwen3MoeExperts

    from fabric_hsdp.models.experts import expert_modules
    from tests.helpers.moe import loss_of
    from tests.helpers.training import make_fabric

    torch.set_num_threads(1)
    fabric = make_fabric(
        num_nodes,
        devices,
        shard_size=shard_size,
        expert_parallel_size=expert_parallel_size,
        # under EP the strategy makes the experts units itself (naming them again would shard them twice)
        sharded_modules={Qwen3MoeDecoderLayer} if expert_parallel_size > 1 else {Qwen3MoeDecoderLayer, Qwen3MoeExperts},
    )
    torch.manual_seed(0)
    with fabric.init_module(empty_init=False):
        model = AutoModelForCausalLM.from_config(model_config())
    if routing == "uniform":
        uniform_routing(model)
    expert_ids = {id(module) for _, module in expert_modules(model)}
    model = fabric.setup_module(model)
    optimizer = fabric.setup_optimizers(torch.optim.SGD(model.parameters(), lr=1e-3))
    generator = torch.Generator().manual_seed(fabric.global_rank)
    vocab = model_config().vocab_size

    def step() -> None:
        tokens = torch.randint(0, vocab, (BATCH, SEQ + 1), generator=generator)
        fabric.backward(loss_of(model, tokens[:, :-1], tokens[:, 1:]))
        optimizer.step()
        optimizer.zero_grad()

    step()  # FSDP2's lazy init
    counter = CollectiveBytes()
    fabric.barrier()
    started = time.perf_counter()
    with charge_fsdp_units(counter, expert_ids), counter:
        for _ in range(steps):
            step()
    seconds = (time.perf_counter() - started) / steps
    return {"sent": {f"{part}/{name}": value / steps for (part, name), value in counter.sent.items()}, "s": seconds}


# ---------------------------------------------------------------------------------------------------------------
# The driver
# ---------------------------------------------------------------------------------------------------------------


def measure(case: Case, steps: int, routing: str, timeout: float, out_dir: Path) -> list[dict[str, Any]]:
    """Each rank's counted bytes per step for ``case``."""
    from benchmarks._harness import run_ranks

    args = {"shard_size": case.shard_size, "expert_parallel_size": case.expert_parallel_size}
    args.update(steps=steps, routing=routing)
    return run_ranks(
        "benchmarks.expert_bytes:count_rank",
        args,
        timeout=timeout,
        out_dir=out_dir,
        num_nodes=case.num_nodes,
        ranks_per_node=case.ranks_per_node,
    )


def per_layer(counted: dict[str, float]) -> dict[str, float]:
    """A rank's counted bytes per step, per MoE layer, in the formula's parts."""
    experts = {name: value for name, value in counted.items() if name.startswith("experts/")}
    return {
        "experts all-gather + reduce-scatter": (
            experts.get("experts/all-gather", 0.0) + experts.get("experts/reduce-scatter (= gloo all-reduce)", 0.0)
        )
        / LAYERS,
        "experts replicate all-reduce": experts.get("experts/all-reduce", 0.0) / LAYERS,
        "token all-to-all": counted.get("token all-to-all/all-to-all", 0.0) / LAYERS,
        "count exchange": counted.get("count exchange/all-to-all", 0.0) / LAYERS,
    }


def compare(case: Case, ranks: list[dict[str, Any]], expert_params: int, routing: str) -> list[dict[str, Any]]:
    """One row per (rank, part): counted per layer, formula, difference; ``checked`` where the formula is exact."""
    expected = formula(case, expert_params)
    rows = []
    for rank, value in enumerate(ranks):
        counted = per_layer(value["sent"])
        for part, predicted in expected.items():
            measured = counted[part]
            difference = measured / predicted - 1 if predicted else (0.0 if measured == 0 else math.inf)
            checked = routing == "uniform" or part != "token all-to-all"
            rows.append(
                {
                    "case": case.label,
                    "rank": rank,
                    "part": part,
                    "counted": measured,
                    "formula": predicted,
                    "difference": difference,
                    "checked": checked,
                }
            )
    return rows


def rest_bytes(ranks: list[dict[str, Any]]) -> float:
    """Rank 0's counted bytes per step of everything but the experts and the exchanges (dense units)."""
    return sum(value for name, value in ranks[0]["sent"].items() if name.startswith("rest/"))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--routing", choices=["uniform", "model"], default="uniform")
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--cases", default="all", help="comma-separated indices into CASES (default all)")
    parser.add_argument("--timeout", type=float, default=300.0)
    args = parser.parse_args(argv)
    cases = CASES if args.cases == "all" else tuple(CASES[int(index)] for index in args.cases.split(","))
    expert_params = expert_parameters_per_layer()
    print(
        f"model: Qwen3-MoE, {LAYERS} layers, hidden {HIDDEN}, {EXPERTS} experts x intermediate {EXPERT_INTERMEDIATE},"
        f" top-{TOP_K}; P_e = {expert_params:,} expert parameters per layer (fp32); {BATCH} x {SEQ} tokens per rank;"
        f" routing {args.routing}; gloo; bytes each rank sends per step, per MoE layer"
    )
    out_dir = Path(tempfile.mkdtemp(prefix="hsdp-expert-bytes-"))
    rows: list[dict[str, Any]] = []
    for index, case in enumerate(cases):
        started = time.monotonic()
        ranks = measure(case, args.steps, args.routing, args.timeout, out_dir / str(index))
        case_rows = compare(case, ranks, expert_params, args.routing)
        rows += case_rows
        print(f"\n{case.label}: {time.monotonic() - started:.0f} s, {ranks[0]['s']:.2f} s/step on rank 0")
        print(f"  {'part (per MoE layer)':<36} {'counted, ranks min..max':>24} {'formula':>10} {'worst diff':>10}")
        for part in formula(case, expert_params):
            mine = [row for row in case_rows if row["part"] == part]
            low, high = min(row["counted"] for row in mine), max(row["counted"] for row in mine)
            worst = max((row["difference"] for row in mine), key=abs)
            note = "" if mine[0]["checked"] else " (model routing: not checked)"
            print(f"  {part:<36} {low:>11,.0f}..{high:>11,.0f} {mine[0]['formula']:>10,.0f} {worst:>+10.1%}{note}")
        print(f"  {'dense units, all layers (rank 0)':<36} {rest_bytes(ranks):>24,.0f}")
        print(
            "  rank 0 by collective, per step: "
            + ", ".join(f"{k} {v:,.0f}" for k, v in sorted(ranks[0]["sent"].items()))
        )
    outside = [row for row in rows if row["checked"] and abs(row["difference"]) > TOLERANCE]
    if outside:
        print(f"\nOUTSIDE {TOLERANCE:.0%}: " + "; ".join(f"{r['case']} rank {r['rank']} {r['part']}" for r in outside))
        return 1
    print(f"\nevery checked part within {TOLERANCE:.0%} of the formula on every rank")
    return 0


if __name__ == "__main__":
    sys.exit(main())
