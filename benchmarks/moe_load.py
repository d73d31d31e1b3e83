"""Bytes each rank reads when ``fabric.load_raw`` fills an HSDP-sharded mixture-of-experts model from the hub's layout.

A Qwen3-MoE made locally (hidden 256, 4 layers, 16 experts of intermediate 256, top-2, vocab 4096; fp32) is saved
with ``save_pretrained``: one tensor per expert (``mlp.experts.7.gate_proj.weight``) while the model holds each
layer's experts fused (``mlp.experts.gate_up_proj`` ``[16, 512, 256]``). On 2 simulated nodes x 2 CPU ranks each
variant builds the model on the meta device, shards it, and loads the directory; a rank counts the tensor bytes it
reads from the file (every read of a checkpoint file ends in ``fileio.readinto``) and the bytes of its own shards.

* ``shard 2``: the default ``shard_size="node"``, mesh ``(2, 2)``: a rank holds 8 of each layer's 16 experts;
* ``shard 4``: ``shard_size="world"``, mesh ``(1, 4)``: 4 experts per rank.

Anchor, measured in the same run: transformers' own ``from_pretrained`` of the same directory in one process (what a
rank does when it loads the whole model and then keeps its shard): the bytes of the file's tensors, and its time
(the second of two calls, warm). Times are on a shared 2-core machine: indicative only; the bytes are exact.
Every load is checked: each rank's weights, gathered, equal ``from_pretrained``'s.

Run: ``python benchmarks/moe_load.py [--work DIR]``.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from benchmarks._harness import run_ranks  # noqa: E402


def _config() -> Any:
    from transformers import Qwen3MoeConfig

    return Qwen3MoeConfig(
        vocab_size=4096,
        hidden_size=256,
        intermediate_size=512,
        moe_intermediate_size=256,
        num_hidden_layers=4,
        num_attention_heads=8,
        num_key_value_heads=4,
        head_dim=32,
        num_experts=16,
        num_experts_per_tok=2,
        decoder_sparse_step=1,
        mlp_only_layers=[],
        tie_word_embeddings=False,
    )


def rank_load(num_nodes: int, devices: int, path: str, shard_size: Any) -> dict[str, Any]:
    from torch.distributed.tensor import DTensor
    from transformers import AutoModelForCausalLM

    from tests.helpers.counters import ReadCounter
    from tests.helpers.training import full_state, make_fabric

    fabric = make_fabric(num_nodes, devices, shard_size=shard_size)
    with fabric.init_module(empty_init=True):
        model = AutoModelForCausalLM.from_config(_config())
    model = fabric.setup_module(model)
    counter = ReadCounter()
    fabric.barrier()
    started = time.perf_counter()
    fabric.load_raw(path, model)
    seconds = time.perf_counter() - started
    read = counter.bytes
    local = {n: t.to_local() if isinstance(t, DTensor) else t for n, t in model.module.state_dict().items()}
    experts = [n for n in local if ".experts." in n]
    reference = AutoModelForCausalLM.from_pretrained(path).state_dict()
    state = full_state(model)
    return {
        "read": read,
        "seconds": seconds,
        "own": sum(t.numel() * t.element_size() for t in local.values()),
        "own_experts": sum(local[n].numel() * local[n].element_size() for n in experts),
        "experts_per_layer": local[experts[0]].shape[0],
        "exact": all(torch.equal(state[n], t) for n, t in reference.items()),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--work", type=Path, default=None)
    args = parser.parse_args()
    from transformers import AutoModelForCausalLM

    work = args.work or Path(tempfile.mkdtemp(prefix="moe-load-"))
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(_config())
    model.save_pretrained(work / "hub")
    state = model.state_dict()
    file_bytes = sum(t.numel() * t.element_size() for t in state.values())
    expert_bytes = sum(t.numel() * t.element_size() for n, t in state.items() if ".experts." in n)
    AutoModelForCausalLM.from_pretrained(work / "hub")  # warm: imports, kernels, page cache
    started = time.perf_counter()
    AutoModelForCausalLM.from_pretrained(work / "hub")
    anchor_seconds = time.perf_counter() - started
    print(f"file: {file_bytes / 2**20:.1f} MiB of tensors, experts {expert_bytes / 2**20:.1f} MiB (16 per layer)")
    print(f"anchor: from_pretrained in one process reads {file_bytes / 2**20:.1f} MiB in {anchor_seconds:.2f} s")
    print("variant | rank | experts held per layer | read MiB | own shard MiB | read / file | own experts / all | s")
    for label, shard_size in (("shard 2", "node"), ("shard 4", "world")):
        values = run_ranks(
            "benchmarks.moe_load:rank_load",
            {"path": str(work / "hub"), "shard_size": shard_size},
            timeout=600,
            out_dir=work / f"launch-{shard_size}",
        )
        for rank, value in enumerate(values):
            assert value["exact"], (label, rank)
            print(
                f"{label} | {rank} | {value['experts_per_layer']} | {value['read'] / 2**20:.2f} |"
                f" {value['own'] / 2**20:.2f} | {value['read'] / file_bytes:.3f} |"
                f" {value['own_experts'] / expert_bytes:.3f} | {value['seconds']:.2f}"
                f" ({value['seconds'] / anchor_seconds:.2f}x anchor)"
            )


if __name__ == "__main__":
    main()
