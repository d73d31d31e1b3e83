"""The GPU check: every path only CUDA reaches, run on the CUDA devices this machine has, one line per path.

Run: ``python benchmarks/gpu_check.py`` (all CUDA devices; about 10-30 s per check). The checks that run as a world
of 1 (all of them on a one-GPU machine) share one ``torchrun --standalone --nproc-per-node 1`` job, each ending its
process group before the next (start-up paid once); a check of N devices gets its own job. A failing check's line says
why and the next one runs. Each line is printed as its result arrives::

    PASS  nccl_init            world 2: backend nccl on cuda:0 and cuda:1, all_reduce of 4 MB in 0.21 ms
    FAIL  cpu_offload          world 2: RuntimeError: No backend type associated with device type cpu
    SKIP  tensor_parallel      needs >= 2 CUDA devices (1 here)

The exit status is 1 if a check failed. Without CUDA it says so and exits 0 (``--device cpu`` rehearses the checks
that also run on CPU, with gloo: a test of this script, not of CUDA; ``GPU_CHECK_CPU_RANKS=1`` rehearses the
one-GPU machine's single job).

Adding a check: write ``def check_name(ctx: Context) -> str`` that builds its run with ``ctx.fabric(...)``, raises
(``assert`` is fine here) when the path is wrong, and returns the figure for its line; then append
``Check("name", check_name, ...)`` to ``CHECKS``. ``min_devices`` skips it on smaller machines, ``cuda_only`` on CPU.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parents[1]
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))
sys.path.insert(0, str(REPO_ROOT / "benchmarks"))

from _processes import end_tree, last_error  # noqa: E402

CHECK_TIMEOUT = 150  # seconds per check, start-up included
TOTAL_BUDGET = 280  # seconds for all checks: the script stays under 5 minutes
SEQ = 16


@dataclass
class Context:
    """What a check runs with, on every rank of its job."""

    device: str  # "cuda" (or "cpu" for the rehearsal)
    devices: int  # ranks in this check's job, one per device
    workdir: Path  # shared by the ranks of this check
    fabrics: list[Any] = field(default_factory=list)  # made by this check, torn down after it

    def fabric(self, precision: str = "32-true", **strategy_kwargs: Any) -> Any:
        import lightning as L

        from examples.tiny_llama import Block
        from fabric_hsdp import HybridFSDPStrategy

        strategy_kwargs.setdefault("sharded_modules", {Block})
        strategy = HybridFSDPStrategy(**strategy_kwargs)
        fabric = L.Fabric(accelerator=self.device, devices=self.devices, strategy=strategy, precision=precision)
        fabric.launch()
        self.fabrics.append(fabric)
        return fabric

    def end(self) -> None:
        """Tear down every fabric of the check (a background save finished, the process group destroyed), so the
        next check in this process starts its own."""
        import torch.distributed as dist

        for fabric in self.fabrics:
            fabric.strategy.teardown()
        self.fabrics.clear()
        if dist.is_initialized():
            dist.destroy_process_group()


@dataclass
class Check:
    name: str
    run: Callable[[Context], str]
    min_devices: int = 1
    cuda_only: bool = False  # no CPU rehearsal (e.g. CPU offload, which refuses a CPU device)
    devices: int | None = None  # ranks to run on (default: all devices)
    requires: tuple[str, ...] = ()  # packages it needs: SKIP, saying what to install, where one is missing


# --------------------------------------------------------------------------------------------------- helpers


def _tiny_llama(seed: int = 0) -> Any:
    import torch

    from examples.tiny_llama import Llama, LlamaConfig

    torch.manual_seed(seed)
    return Llama(LlamaConfig(vocab_size=256, dim=64, n_layers=2, n_heads=4, hidden_dim=96, max_seq_len=SEQ))


def _batch(device: Any, rows: int = 2, seed: int = 1) -> tuple[Any, Any]:
    import torch

    generator = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, 256, (rows, SEQ + 1), generator=generator)
    return tokens[:, :-1].to(device), tokens[:, 1:].to(device)


def _loss(model: Any, inputs: Any, targets: Any) -> Any:
    import torch

    logits = model(inputs)
    return torch.nn.functional.cross_entropy(logits.float().flatten(0, 1), targets.flatten())


def _full_state(model: Any) -> dict[str, Any]:
    from torch.distributed.tensor import DTensor

    state = {}
    for name, tensor in getattr(model, "module", model).state_dict().items():
        tensor = tensor.full_tensor() if isinstance(tensor, DTensor) else tensor
        state[name] = tensor.detach().cpu().clone()
    return state


def _mismatches(state: dict[str, Any], expected: dict[str, Any]) -> list[str]:
    import torch

    return [name for name in expected if name not in state or not torch.equal(state[name].float(), expected[name])]


def _local_devices(model: Any) -> set[str]:
    return {str(p.to_local().device.type) for p in model.parameters()}


def _reference_file(ctx: Context, fabric: Any, name: str = "reference.pth") -> tuple[Path, dict[str, Any]]:
    """A raw state dict of the tiny LLaMA (seed 0), written by rank 0; returns its path and the tensors."""
    import torch

    reference = {name: tensor.float() for name, tensor in _tiny_llama(seed=0).state_dict().items()}
    path = ctx.workdir / name
    if fabric.global_rank == 0:
        torch.save(reference, path)
    fabric.barrier()
    return path, reference


def _steps(fabric: Any, model: Any, optimizer: Any, count: int, clip: float | None = None) -> tuple[list[float], float]:
    """``count`` optimizer steps; returns the losses and the median seconds per step (after the first)."""
    import torch

    losses, seconds = [], []
    for step in range(count):
        inputs, targets = _batch(fabric.device, seed=step + fabric.global_rank)
        start = time.perf_counter()
        loss = _loss(model, inputs, targets)
        fabric.backward(loss)
        if clip is not None:
            norm = fabric.clip_gradients(model, optimizer, max_norm=clip)
            if not torch.isfinite(norm):
                raise AssertionError(f"gradient norm {norm} is not finite")
        optimizer.step()
        optimizer.zero_grad()
        if fabric.device.type == "cuda":
            torch.cuda.synchronize()
        seconds.append(time.perf_counter() - start)
        losses.append(loss.item())
    return losses, statistics.median(seconds[1:] or seconds)


# ---------------------------------------------------------------------------------------------------- checks


def check_nccl_init(ctx: Context) -> str:
    import torch
    import torch.distributed as dist

    fabric = ctx.fabric()
    backend = str(dist.get_backend())
    expected = "nccl" if ctx.device == "cuda" else "gloo"
    assert backend == expected, f"backend {backend}, expected {expected}"
    if ctx.device == "cuda":
        local_rank = int(os.environ["LOCAL_RANK"])
        assert fabric.device == torch.device("cuda", local_rank), f"rank on {fabric.device}, not cuda:{local_rank}"
        assert torch.cuda.current_device() == local_rank, f"current device {torch.cuda.current_device()}"
    value = torch.full((1,), float(fabric.global_rank + 1), device=fabric.device)
    dist.all_reduce(value)
    assert value.item() == ctx.devices * (ctx.devices + 1) / 2, f"all_reduce gave {value.item()}"
    payload = torch.ones(1 << 20, device=fabric.device)
    times = []
    for _ in range(5):
        fabric.barrier()
        start = time.perf_counter()
        dist.all_reduce(payload)
        if ctx.device == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    local_ranks = fabric.all_gather(torch.tensor(fabric.local_rank, device=fabric.device)).flatten().tolist()
    devices = sorted({str(rank) for rank in local_ranks})
    return f"backend {backend}, ranks on {ctx.device}:{','.join(devices)}, all_reduce of 4 MB {1e3 * min(times):.2f} ms"


def check_bf16_mixed(ctx: Context) -> str:
    import torch

    fabric = ctx.fabric(precision="bf16-mixed")
    with fabric.init_module(empty_init=True):
        model = _tiny_llama()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model, optimizer = fabric.setup(model, optimizer)
    master = {p.dtype for p in model.parameters()}
    assert master == {torch.float32}, f"master shards {master}, expected float32"
    compute = []
    linear = model.module.layers[0].attention.wq
    handle = linear.register_forward_pre_hook(lambda module, args: compute.append(module.weight.dtype))
    losses, step = _steps(fabric, model, optimizer, 4)
    handle.remove()
    assert set(compute) == {torch.bfloat16}, f"forward computed in {set(compute)}, expected bfloat16"
    inputs, targets = _batch(fabric.device)
    fabric.backward(_loss(model, inputs, targets))
    grads = {p.grad.dtype for p in model.parameters() if p.grad is not None}
    assert grads == {torch.float32}, f"sharded gradients reduced into {grads}, expected float32"
    optimizer.zero_grad()
    assert all(torch.isfinite(torch.tensor(losses))), losses
    assert losses[-1] < losses[0], f"loss did not go down: {losses}"
    return (
        f"compute bf16, master shards and reduced gradients fp32, loss {losses[0]:.3f} ->"
        f" {losses[-1]:.3f}, {1e3 * step:.1f} ms/step"
    )


def check_meta_init_raw_load(ctx: Context) -> str:
    fabric = ctx.fabric()
    path, reference = _reference_file(ctx, fabric)
    with fabric.init_module(empty_init=True):
        model = _tiny_llama(seed=1)
    model = fabric.setup_module(model)
    devices = _local_devices(model)
    assert devices == {ctx.device}, f"local shards on {devices}, expected {ctx.device}"
    start = time.perf_counter()
    fabric.load_raw(path, model)
    seconds = time.perf_counter() - start
    wrong = _mismatches(_full_state(model), reference)
    assert not wrong, f"{len(wrong)} tensors differ from the file after load_raw, e.g. {wrong[:3]}"
    return f"meta init -> {ctx.device} shards, load_raw of {len(reference)} tensors exact in {seconds:.2f} s"


def check_async_save(ctx: Context) -> str:
    import torch

    fabric = ctx.fabric(async_save=True)
    with fabric.init_module(empty_init=True):
        model = _tiny_llama()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model, optimizer = fabric.setup(model, optimizer)
    _steps(fabric, model, optimizer, 1)
    saved = _full_state(model)
    start = time.perf_counter()
    fabric.save(ctx.workdir / "async", {"model": model, "optimizer": optimizer})
    blocked = time.perf_counter() - start
    _steps(fabric, model, optimizer, 1)  # changes the shards while the staged copy is written
    fabric.strategy.wait_for_checkpoint()
    committed = time.perf_counter() - start
    changed = _mismatches(_full_state(model), saved)
    assert changed, "the step after the save changed no parameter: the check cannot tell staging from live shards"
    with fabric.init_module(empty_init=True):
        fresh = _tiny_llama(seed=5)
    fresh_optimizer = torch.optim.AdamW(fresh.parameters(), lr=1e-2)
    fresh, fresh_optimizer = fabric.setup(fresh, fresh_optimizer)
    fabric.load(ctx.workdir / "async", {"model": fresh, "optimizer": fresh_optimizer})
    wrong = _mismatches(_full_state(fresh), saved)
    assert not wrong, f"{len(wrong)} tensors differ from what was saved, e.g. {wrong[:3]}"
    return f"save blocked {1e3 * blocked:.0f} ms of {1e3 * committed:.0f} ms to commit; the load is the state at save"


def check_cpu_offload(ctx: Context) -> str:
    import torch
    import torch.distributed as dist

    shard_size = ctx.devices // 2 if ctx.devices >= 2 else 1  # two replicas where there are 2+ devices
    fabric = ctx.fabric(cpu_offload=True, shard_size=shard_size)
    backend = str(dist.get_backend())
    assert backend == "cpu:gloo,cuda:nccl", f"backend {backend}"
    fabric.seed_everything(7)  # one seed on every rank: shard peers must still differ
    with fabric.init_module(empty_init=True):
        model = _tiny_llama()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model, optimizer = fabric.setup(model, optimizer)
    devices = _local_devices(model)
    assert devices == {"cpu"}, f"offloaded shards on {devices}"
    weight = model.module.layers[0].feed_forward.w1.weight
    full = weight.full_tensor()
    if shard_size >= 2:
        rows = full.shape[0] // shard_size
        assert not torch.equal(full[:rows], full[rows : 2 * rows]), "shard peers drew the same initial values"
    mesh = fabric.strategy.parallel_mesh
    local = weight.to_local().contiguous()
    replicas = [torch.empty_like(local) for _ in range(mesh.replicate.size())]
    dist.all_gather(replicas, local, group=mesh.group("replicate"))
    assert all(torch.equal(replicas[0], other) for other in replicas[1:]), "replicas differ after setup"
    losses, step = _steps(fabric, model, optimizer, 2, clip=1.0)
    full_path = ctx.workdir / "offload-full.pth"
    fabric.strategy.save_full_checkpoint(full_path, {"model": model})
    expected = _full_state(model)
    with fabric.init_module(empty_init=True):
        fresh = _tiny_llama(seed=3)
    fresh = fabric.setup_module(fresh)
    fabric.strategy.load_raw(full_path, fresh, load_mode="rank0")
    wrong = _mismatches(_full_state(fresh), expected)
    assert not wrong, f"{len(wrong)} tensors differ after the full save and rank0 load, e.g. {wrong[:3]}"
    return (
        f"backend {backend}, mesh {tuple(mesh.device_mesh.shape)}, shards on cpu, replicas equal, clipped steps"
        f" {1e3 * step:.0f} ms, full save + rank0 load exact"
    )


def check_fp16_offload_overflow(ctx: Context) -> str:
    import torch

    fabric = ctx.fabric(precision="16-mixed", cpu_offload=True)
    with fabric.init_module(empty_init=True):
        model = _tiny_llama()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model, optimizer = fabric.setup(model, optimizer)
    inputs, targets = _batch(fabric.device, seed=fabric.global_rank)
    fabric.backward(_loss(model, inputs, targets))
    if fabric.global_rank == ctx.devices - 1:  # an overflow in the last rank's gradient shard only (CPU memory)
        next(p for p in model.parameters() if p.grad is not None).grad.to_local().view(-1)[0] = float("inf")
    before = [p.to_local().clone() for p in model.parameters()]
    scale = fabric.strategy.precision.scaler.get_scale()
    optimizer.step()
    stepped = any(not torch.equal(b, p.to_local()) for b, p in zip(before, model.parameters()))
    new_scale = fabric.strategy.precision.scaler.get_scale()
    assert not stepped, "a rank stepped although another rank's gradients overflowed"
    assert new_scale == scale / 2, f"scale {scale} -> {new_scale}, expected one back-off"
    return f"found-inf on CPU shards agreed: step skipped, scale {scale:g} -> {new_scale:g}"


def check_tensor_parallel(ctx: Context) -> str:
    import torch

    fabric = ctx.fabric(tensor_parallel_size=2)
    path, reference_state = _reference_file(ctx, fabric, "tp-reference.pth")
    with fabric.init_module(empty_init=True):
        model = _tiny_llama(seed=1)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model, optimizer = fabric.setup(model, optimizer)
    fabric.load_raw(path, model)
    reference = _tiny_llama(seed=0).to(fabric.device)
    inputs, _ = _batch(fabric.device)
    with torch.no_grad():
        difference = (model(inputs) - reference(inputs)).abs().max().item()
    assert difference < 1e-4, f"logits differ from one device's by {difference}"
    losses, step = _steps(fabric, model, optimizer, 3)
    assert all(torch.isfinite(torch.tensor(losses))), losses
    shape = tuple(fabric.strategy.device_mesh.shape)
    return f"mesh {shape}, logits vs one device max |diff| {difference:.1e}, {1e3 * step:.1f} ms/step"


def check_shard_size_auto(ctx: Context) -> str:
    import torch

    fabric = ctx.fabric(shard_size="auto")
    free, total = torch.cuda.mem_get_info(fabric.device)
    with fabric.init_module(empty_init=True):
        model = _tiny_llama()
    model = fabric.setup_module(model)
    topology = fabric.strategy.topology
    return f"mem_get_info free {free / 1e9:.1f} of {total / 1e9:.1f} GB; chose shard_size {topology.shard_size}"


def check_transformers_init(ctx: Context) -> str:
    from transformers import LlamaConfig, LlamaForCausalLM
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer

    config = LlamaConfig(
        vocab_size=256, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=SEQ, pad_token_id=3, initializer_range=0.02,
    )  # fmt: skip
    fabric = ctx.fabric(sharded_modules={LlamaDecoderLayer})
    fabric.seed_everything(100 + fabric.global_rank)
    with fabric.init_module(empty_init=True):
        model = LlamaForCausalLM(config)
    model = fabric.setup_module(model)
    embedding = model.module.model.embed_tokens.weight.full_tensor()
    q_proj = model.module.model.layers[0].self_attn.q_proj.weight.full_tensor()
    assert (embedding[3] == 0).all(), "padding row not zero"
    for name, tensor in (("embedding", embedding), ("q_proj", q_proj)):
        std = tensor.float().std().item()
        assert abs(std - 0.02) < 0.002, f"{name} std {std:.4f}, transformers' init gives 0.02"
    return f"embedding std {embedding.std().item():.4f}, q_proj std {q_proj.std().item():.4f} (0.02), padding row 0"


def check_qlora(ctx: Context) -> str:
    """A QLoRA model as a user builds it (transformers' BitsAndBytesConfig(load_in_4bit=True), peft's
    prepare_model_for_kbit_training and LoRA): setup_module must refuse its 4-bit base with the reason and what works
    (fabric_hsdp/adapters/quantized.py); the line shows what happens on this device (without bitsandbytes: SKIP)."""
    import torch
    from peft import LoraConfig, get_peft_model, prepare_model_for_kbit_training
    from transformers import BitsAndBytesConfig, LlamaConfig, LlamaForCausalLM
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer

    fabric = ctx.fabric(precision="bf16-mixed", sharded_modules={LlamaDecoderLayer})
    config = LlamaConfig(
        vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=SEQ,
    )  # fmt: skip
    base = ctx.workdir / f"base-rank{fabric.global_rank}"
    LlamaForCausalLM(config).save_pretrained(base)
    quantized = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_compute_dtype=torch.bfloat16)
    model = LlamaForCausalLM.from_pretrained(base, quantization_config=quantized, device_map={"": fabric.device})
    model = get_peft_model(prepare_model_for_kbit_training(model), LoraConfig(r=4, target_modules=["q_proj"]))
    kinds = sorted({type(p).__name__ for p in model.parameters()})
    try:
        fabric.setup_module(model)
    except ValueError as error:
        message = str(error)
        assert "does not support quantized bases yet" in message and "precision='bf16-mixed'" in message, message
        return f"refused at setup_module, as it must (parameter classes {kinds}): {message[:150]}..."
    raise AssertionError(f"a 4-bit QLoRA base (parameter classes {kinds}) was accepted by setup_module")


def check_float8(ctx: Context) -> str:
    """float8=True (torchao rowwise) under bf16-mixed: the eligible linears converted, the loss finite and falling;
    on a GPU below SM 8.9 the strategy must refuse at construction, which is the pass (without torchao: SKIP)."""
    import torch

    from examples.tiny_llama import Block, Llama, LlamaConfig
    from fabric_hsdp.setup.float8 import float8_unsupported_reason

    reason = float8_unsupported_reason()
    if reason is not None:
        try:
            ctx.fabric(precision="bf16-mixed", float8=True)
        except RuntimeError as error:
            assert reason in str(error), str(error)
            return f"refused at construction, as it must here: {reason}"
        raise AssertionError(f"float8=True was accepted although {reason}")
    from torchao.float8.float8_linear import Float8Linear

    fabric = ctx.fabric(precision="bf16-mixed", float8=True, sharded_modules={Block})
    torch.manual_seed(0)
    with fabric.init_module(empty_init=True):
        model = Llama(LlamaConfig(vocab_size=256, dim=256, n_layers=2, n_heads=4, hidden_dim=512, max_seq_len=SEQ))
    model = fabric.setup_module(model)
    optimizer = fabric.setup_optimizers(torch.optim.AdamW(model.parameters(), lr=1e-3))
    converted = [name for name, module in model.module.named_modules() if isinstance(module, Float8Linear)]
    assert converted and "output" not in converted, converted
    losses, step = _steps(fabric, model, optimizer, 4)
    assert all(torch.isfinite(torch.tensor(losses))), losses
    assert losses[-1] < losses[0], f"loss did not go down: {losses}"
    return (
        f"{len(converted)} float8 linears (output head kept), loss {losses[0]:.3f} -> {losses[-1]:.3f},"
        f" {1e3 * step:.1f} ms/step"
    )


CHECKS = [
    Check("nccl_init", check_nccl_init),
    Check("bf16_mixed", check_bf16_mixed),
    Check("meta_init_raw_load", check_meta_init_raw_load),
    Check("async_save", check_async_save),
    Check("cpu_offload", check_cpu_offload, cuda_only=True),
    Check("fp16_offload_overflow", check_fp16_offload_overflow, cuda_only=True),
    Check("tensor_parallel", check_tensor_parallel, min_devices=2, devices=2),
    Check("shard_size_auto", check_shard_size_auto, cuda_only=True),
    Check("transformers_init", check_transformers_init, requires=("transformers",)),
    Check("float8", check_float8, requires=("torchao",), cuda_only=True),
    Check("qlora", check_qlora, requires=("bitsandbytes", "peft", "transformers")),
]


# ---------------------------------------------------------------------------------------------------- driver


def _run_in_job(names: list[str], device: str, workdir: Path, results: Path) -> None:
    """Inside a check job: run the named checks one after another on this rank; rank 0 appends a JSON line per
    check to ``results`` as it finishes (a failure is recorded and the next check still runs)."""
    import traceback

    rank = int(os.environ.get("RANK", "0"))
    for name in names:
        check = next(check for check in CHECKS if check.name == name)
        ctx = Context(device=device, devices=int(os.environ.get("WORLD_SIZE", "1")), workdir=workdir / name)
        ctx.workdir.mkdir(parents=True, exist_ok=True)
        start = time.monotonic()
        try:
            line = {"name": name, "figure": check.run(ctx)}
        except Exception as error:  # the check failed: its line says why, the next one runs
            line = {"name": name, "error": f"{type(error).__name__}: {error}"[:300], "trace": traceback.format_exc()}
            if ctx.devices > 1:  # the other ranks may wait in a collective: end the job (its own check only)
                raise
        finally:
            ctx.end()
        line["seconds"] = round(time.monotonic() - start, 1)
        if rank == 0:
            with results.open("a") as file:
                file.write(json.dumps(line) + "\n")


def _runnable(args: argparse.Namespace, available: int) -> list[tuple[Check, int]]:
    """The checks to run with their world sizes; prints a SKIP line for each of the others."""
    runnable = []
    for check in CHECKS:
        if args.only is not None and check.name not in args.only:
            continue
        label = f"{check.name:<22}"
        missing = [package for package in check.requires if importlib.util.find_spec(package) is None]
        if args.device == "cpu" and check.cuda_only:
            print(f"SKIP  {label} needs CUDA")
        elif available < check.min_devices:
            print(f"SKIP  {label} needs >= {check.min_devices} CUDA devices ({available} here)")
        elif missing:
            print(f"SKIP  {label} needs {', '.join(missing)}: pip install {' '.join(missing)}")
        else:
            runnable.append((check, min(check.devices or available, available)))
    return runnable


def _jobs(runnable: list[tuple[Check, int]]) -> list[tuple[list[str], int]]:
    """One job for all world-1 checks (start-up paid once: 10-20 s each on a GPU machine), one per larger check."""
    single = [check.name for check, world in runnable if world == 1]
    return ([(single, 1)] if single else []) + [([check.name], world) for check, world in runnable if world > 1]


def _run_job(names: list[str], world: int, device: str, timeout: float) -> int:
    """Run one check job, printing each check's line as its result arrives; returns the number failed."""
    with tempfile.TemporaryDirectory(prefix="gpu-check-") as workdir:
        results = Path(workdir) / "results.jsonl"
        command = [
            sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={world}", __file__,
            "--check", ",".join(names), "--device", device, "--workdir", workdir, "--result", str(results),
        ]  # fmt: skip
        env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO_ROOT), os.environ.get("PYTHONPATH", "")]))
        env.setdefault("OMP_NUM_THREADS", "1")
        log = Path(workdir) / "job.log"
        start = time.monotonic()
        shown, failed = 0, 0
        with log.open("w") as output:
            job = subprocess.Popen(command, stdout=output, stderr=subprocess.STDOUT, env=env, cwd=REPO_ROOT)
            while True:
                code = job.poll()
                lines = results.read_text().splitlines() if results.exists() else []
                for line in map(json.loads, lines[shown:]):
                    label = f"{line['name']:<22}"
                    if "figure" in line:
                        print(f"PASS  {label} world {world}: {line['figure']} [{line['seconds']:.0f} s]", flush=True)
                    else:
                        failed += 1
                        print(f"FAIL  {label} world {world}: {line['error']} [{line['seconds']:.0f} s]", flush=True)
                        if os.environ.get("GPU_CHECK_VERBOSE"):
                            print(line["trace"][-6000:], flush=True)
                shown = len(lines)
                if code is not None:
                    break
                if time.monotonic() - start > timeout:
                    end_tree(job)  # torchrun and its workers, which run in sessions of their own
                    code = "timeout"
                    break
                time.sleep(0.5)
        if shown < len(names):  # the job died (or ran out of time) before these checks reported
            reason = f"timed out after {timeout:.0f} s" if code == "timeout" else last_error(log.read_text())
            for name in names[shown:]:
                failed += 1
                print(f"FAIL  {name:<22} world {world}: {reason}", flush=True)
            if os.environ.get("GPU_CHECK_VERBOSE"):
                print(log.read_text()[-6000:], flush=True)
        return failed


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda", help="cpu: rehearse on gloo")
    parser.add_argument("--only", nargs="*", default=None, help="names of the checks to run")
    parser.add_argument("--budget", type=float, default=None, help=f"seconds for all checks (CUDA: {TOTAL_BUDGET})")
    parser.add_argument("--check", help=argparse.SUPPRESS)  # inside a check job: the checks, comma-separated
    parser.add_argument("--workdir", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--result", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.check:
        _run_in_job(args.check.split(","), args.device, args.workdir, args.result)
        return 0

    import torch

    if args.device == "cuda":
        if not torch.cuda.is_available():
            print("gpu_check: no CUDA device on this machine: nothing checked (exit 0). Run it where a GPU is.")
            return 0
        available = torch.cuda.device_count()
        names = sorted({torch.cuda.get_device_name(i) for i in range(available)})
        print(f"gpu_check: {available} CUDA device(s) ({', '.join(names)}), torch {torch.__version__}", flush=True)
    else:
        available = 2 if os.environ.get("GPU_CHECK_CPU_RANKS", "2") == "2" else 1
        print(f"gpu_check: CPU rehearsal on {available} gloo rank(s) (not a CUDA check)", flush=True)
    budget = args.budget or (TOTAL_BUDGET if args.device == "cuda" else 3600.0)  # a loaded CPU box starts slowly
    deadline = time.monotonic() + budget
    failed = 0
    for names, world in _jobs(_runnable(args, available)):
        left = deadline - time.monotonic()
        if left < 20:
            for name in names:
                print(f"SKIP  {name:<22} out of time (the script keeps under {budget:.0f} s)")
            continue
        per_job = CHECK_TIMEOUT * len(names) if args.device == "cuda" else budget
        failed += _run_job(names, world, args.device, min(per_job, left))
    print(f"gpu_check: {failed} failed")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
