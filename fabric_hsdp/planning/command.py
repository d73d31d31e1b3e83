"""``fabric-hsdp plan``: its arguments and what it prints. ``fabric_hsdp.cli`` registers it and reports errors."""

from __future__ import annotations

import json
from typing import Any

from fabric_hsdp.planning.memory import OPTIMIZERS
from fabric_hsdp.planning.plan import DEFAULT_SAFETY_MARGIN
from fabric_hsdp.setup.precision import PRECISION_DTYPES

PLAN_HELP = """Which shard_size (and tensor_parallel_size) fits a model in device memory with the shortest estimated
step time, compute and communication included (the bandwidths given, else a typical H100 node's, stated in the
output), every layout at one global batch (--global_batch_size, else the devices x --micro_batch_size). Each layout
weighs the levers experts pull: the largest micro-batch that fits (fewer micro-batches, fewer gathers per step),
selective or full activation checkpointing where it lets a larger micro-batch fit, and the weights kept gathered for
the step (one gather per step) where memory allows. The recommendation says which lever won and by how much, and
names the runner-up.

MODEL: a transformers config.json or its directory, a litgpt model_config.yaml or config name (e.g. Llama-2-7b-hf),
or any checkpoint fabric-hsdp can open (shapes from its header; no tensor data is read). One row per layout the
topology accepts: per-device bytes of parameters, gradients, optimizer state, gathered units and activations (an
estimate), the total against the device memory, and the bytes per step between nodes and within a node.

With --lora_r R the base is frozen (no gradients, no optimizer state, held in the compute dtype) and LoRA adapters of
rank R train on every linear layer of the blocks (or --lora_targets), as examples/finetune.py --lora_r does.
"""


def plan_parser() -> Any:
    """The ``plan`` subcommand's parser (jsonargparse; nothing heavy is imported)."""
    from jsonargparse import ActionConfigFile, ArgumentParser

    parser = ArgumentParser(description=PLAN_HELP, exit_on_error=False)
    parser.add_argument("--config", action=ActionConfigFile, help="YAML/JSON file with the arguments")
    parser.add_argument("model", type=str, help="config.json (or its directory), litgpt config, or checkpoint")
    parser.add_argument("--num_nodes", type=int, default=1, help="nodes in the job")
    parser.add_argument("--devices_per_node", type=int, default=8, help="devices (ranks) per node")
    parser.add_argument("--device_memory", type=str, default="80GB", help="memory per device, e.g. 80GB or 40GiB")
    parser.add_argument(
        "--inter_node_bandwidth", type=str | None, default=None, help="per node, e.g. 400Gbit/s (adds a time column)"
    )
    parser.add_argument(
        "--intra_node_bandwidth", type=str | None, default=None, help="per device, e.g. 450GB/s (adds a time column)"
    )
    parser.add_argument("--precision", type=str, default="bf16-mixed", choices=list(PRECISION_DTYPES))
    parser.add_argument("--optimizer", type=str, default="adamw", choices=list(OPTIMIZERS), help="sgd = with momentum")
    parser.add_argument(
        "--micro_batch_size", type=int, default=1, help="sequences per forward; sets the default global batch"
    )
    parser.add_argument(
        "--global_batch_size",
        type=int | None,
        default=None,
        help="sequences per optimizer step, every layout (default: devices / smallest TP x micro_batch_size)",
    )
    parser.add_argument("--seq_len", type=int, default=2048, help="tokens per sequence")
    parser.add_argument(
        "--activation_checkpointing",
        type=bool | None,
        default=None,
        help="default: weigh none, selective and full per layout; true: only --activation_checkpointing_mode (where"
        " needed to fit); false: never",
    )
    parser.add_argument(
        "--activation_checkpointing_mode", type=str, default="full", help="full, selective, none or k (every k-th)"
    )
    parser.add_argument(
        "--keep_gathered_while_accumulating",
        type=bool | None,
        default=None,
        help="default: weigh keeping the weights gathered for the step per layout; true: always; false: never",
    )
    parser.add_argument("--sequence_parallel", type=bool, default=False, help="sequence parallelism with TP")
    parser.add_argument("--loss_parallel", type=bool, default=False, help="vocabulary-sharded loss with TP")
    parser.add_argument(
        "--device_flops", type=str | None, default=None, help="peak FLOP/s per device, e.g. 989TFLOPS (with bandwidths)"
    )
    parser.add_argument(
        "--compute_efficiency", type=float, default=0.4, help="fraction of the peak the model runs at (with bandwidths)"
    )
    parser.add_argument(
        "--lora_r", type=int | None, default=None, help="LoRA rank: the base frozen, adapters on the linear layers"
    )
    parser.add_argument(
        "--lora_targets",
        type=list[str] | None,
        default=None,
        help="with --lora_r: module names as peft's target_modules (default: every linear layer of the blocks)",
    )
    parser.add_argument("--cpu_offload", type=bool, default=False, help="sharded state in CPU memory")
    parser.add_argument(
        "--reshard_after_forward", type=bool | None, default=None, help="as HybridFSDPStrategy's (default: FSDP2's)"
    )
    parser.add_argument(
        "--tensor_parallel_size", type=int | None, default=None, help="only this TP size (default: all)"
    )
    parser.add_argument(
        "--expert_parallel_size",
        type=int | None,
        default=None,
        help="only this expert-parallel size (default: every size the model's experts allow; 1: none)",
    )
    parser.add_argument(
        "--context_parallel_size",
        type=int | None,
        default=None,
        help="only this context-parallel size (default: every size the topology allows; 1: none)",
    )
    parser.add_argument(
        "--safety_margin", type=float, default=DEFAULT_SAFETY_MARGIN, help="fraction of memory kept free"
    )
    parser.add_argument("--backend", type=str, default="nccl", choices=["nccl", "gloo"], help="collectives' library")
    parser.add_argument("--json", action="store_true", help="print one JSON object with a 'layouts' list")
    parser.add_argument(
        "--verify", action="store_true", help="dry-run the recommended layout (rank 0, one step): measured vs planned"
    )
    parser.add_argument("--debug", action="store_true", help="show tracebacks on errors")
    return parser


def run_plan(args: Any) -> None:
    """Print the plan for the parsed ``args`` (table or JSON).

    Raises:
        NoLayoutFitsError: After printing, when no layout fits (the CLI reports it as one line, exit code 2).
    """
    from fabric_hsdp.planning.memory import Training, Workload
    from fabric_hsdp.planning.plan import Cluster, make_plan, no_fit_error
    from fabric_hsdp.planning.report import plan_dict, plan_table
    from fabric_hsdp.planning.sources import load_model_shape

    cluster = Cluster(
        num_nodes=args.num_nodes,
        devices_per_node=args.devices_per_node,
        device_memory=args.device_memory,
        inter_node_bandwidth=args.inter_node_bandwidth,
        intra_node_bandwidth=args.intra_node_bandwidth,
        backend=args.backend,
        device_flops=args.device_flops,
        compute_efficiency=args.compute_efficiency,
    )
    training = Training(
        precision=args.precision,
        workload=Workload(args.micro_batch_size, args.seq_len, args.optimizer),
        activation_checkpointing=bool(args.activation_checkpointing),
        cpu_offload=args.cpu_offload,
        reshard_after_forward=args.reshard_after_forward,
        activation_checkpointing_mode=args.activation_checkpointing_mode,
        sequence_parallel=args.sequence_parallel,
        loss_parallel=args.loss_parallel,
        keep_gathered_while_accumulating=bool(args.keep_gathered_while_accumulating),
    )
    sizes = None if args.tensor_parallel_size is None else [args.tensor_parallel_size]
    model = load_model_shape(args.model)
    if args.lora_r is not None:
        from fabric_hsdp.planning.lora import with_lora

        model = with_lora(model, args.lora_r, args.lora_targets)
    elif args.lora_targets is not None:
        raise ValueError("--lora_targets adapts the layers of a LoRA plan: pass --lora_r R with it.")
    weigh = (args.activation_checkpointing is None, args.keep_gathered_while_accumulating is None)
    experts = None if args.expert_parallel_size is None else [args.expert_parallel_size]
    contexts = None if args.context_parallel_size is None else [args.context_parallel_size]
    plan = make_plan(
        model, cluster, training, args.safety_margin, sizes, args.global_batch_size, True, *weigh, experts, contexts
    )
    error = no_fit_error(plan, args.tensor_parallel_size) if plan.recommended is None else None
    verify = args.verify and error is None  # the dry run's own module builds and runs it (fabric_hsdp/dryrun/verify.py)
    if args.json:
        document = plan_dict(plan)
        document["error"] = None if error is None else str(error)
        if verify:
            from fabric_hsdp.dryrun.verify import verify_plan

            document["verify"] = verify_plan(args, plan)[1].as_dict()
        print(json.dumps(document, indent=2))
    else:
        print(plan_table(plan))
        if verify:
            from fabric_hsdp.dryrun.verify import verify_plan

            print(verify_plan(args, plan)[0])
    if error is not None:
        raise error
