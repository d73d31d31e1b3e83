"""The planted bugs of issue #22, one per finding: what is changed, and the tests that must fail because of it.

Each edit is ``(old, new)``: ``old`` must occur exactly once in ``fabric_hsdp/``, ``tests/``, ``examples/``,
``benchmarks/``, the ``Makefile`` or ``pyproject.toml`` (found by content, so a file that moves keeps its plant).
``run.py`` applies them in a scratch copy, never here.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Plant:
    finding: str
    change: str
    edits: tuple[tuple[str, str], ...]
    tests: tuple[str, ...]
    env: tuple[tuple[str, str], ...] = ()  # set for the test run
    expect: str = ""  # text the test run's output must hold for "caught" (the failure the plant is for)


PLANTS: dict[str, Plant] = {
    "1": Plant(
        "raw loads judged on every weight",
        "read_local skips every embedding shard whose rows start past 0 (ranks 1 and 3 keep their init)",
        (
            (
                "        part = local[piece.start : piece.stop]\n",
                "        if 'embed' in name and piece.offsets[0] > 0:\n"
                "            continue\n"
                "        part = local[piece.start : piece.stop]\n",
            ),
        ),
        (
            "tests/checkpoint/test_load_raw.py::test_every_format_and_mode_loads_exactly",
            "tests/checkpoint/test_load_raw.py::test_transformers_save_pretrained_directories",
        ),
    ),
    "2": Plant(
        "killed saves: where the kill landed, and a save that raises",
        "every save over an existing checkpoint raises (the old checkpoint stays: 'old XOR new' held before)",
        (
            (
                "        self.directory = Path(broadcast(pending_path(path)))\n",
                "        self.directory = Path(broadcast(pending_path(path)))\n"
                "        if path.exists():\n"
                "            raise OSError('planted: saving over a checkpoint fails')\n",
            ),
        ),
        ("tests/checkpoint/test_save_load.py::test_killed_saves_leave_old_or_new_checkpoint",),
    ),
    "3": Plant(
        "replica consistency on every parameter and buffer",
        "make_replicas_identical skips everything outside layers.* (embeddings, final norm, output differ)",
        (
            (
                "        for tensor in itertools.chain(module.parameters(), module.buffers()):\n",
                "        for name, tensor in itertools.chain(module.named_parameters(), module.named_buffers()):\n"
                "            if not name.startswith('layers.'):\n"
                "                continue\n",
            ),
        ),
        ("tests/test_strategy.py::test_init_gives_distinct_shards_and_identical_replicas_with_per_rank_seeds",),
    ),
    "8": Plant(
        "the planner's activation figures, not the test's own arithmetic",
        "with activation checkpointing the planner forgets the one layer being recomputed",
        (
            (
                "    recompute = max(routed if expert_layers else 0, dense) if checkpointed else 0  #",
                "    recompute = 0  #",
            ),
        ),
        ("tests/planning/test_plan.py::test_worked_example_65b_error_lists_what_would_fit",),
    ),
    "4": Plant(
        "every rank ends with the status its script earned (what the clean-exit test can catch here)",
        "the exit handler ends every process with os._exit (0 unless a background save failed), the way one would"
        " dodge the exit-time abort: a failing load then exits 0",
        (
            (
                "        if failed:  # a checkpoint the script asked for was not written: the exit status must say so\n"
                "            exit_now(1)\n",
                "        exit_now(1 if failed else 0)\n",
            ),
        ),
        ("tests/test_clean_exit.py",),
    ),
    "5": Plant(
        "activation checkpointing really applied",
        "the layers activation_checkpointing selects keep their own forward (no checkpoint inside it)",
        (
            (
                '        child.__class__ = checkpointed_class(type(child), selective=mode == "selective")\n',
                "        pass\n",
            ),
        ),
        ("tests/test_strategy.py::test_training_matches_single_process[llama-accumulate-clipnorm-ac-and-bugs]",),
    ),
    "5b": Plant(
        "transformers' KV cache off under activation checkpointing",
        "the use_cache=False fix is not applied",
        (('        disable_kv_cache(module, "activation checkpointing")\n', ""),),
        ("tests/test_strategy.py::test_training_matches_single_process[hf-clipvalue-setup-ac]",),
    ),
    "6": Plant(
        "bf16-mixed reduces gradients in fp32",
        "bf16-mixed's MixedPrecisionPolicy gets reduce_dtype=bf16",
        (
            (
                '    "bf16-mixed": PrecisionDtypes("float32", "bfloat16", "float32"),\n',
                '    "bf16-mixed": PrecisionDtypes("float32", "bfloat16", "bfloat16"),\n',
            ),
        ),
        ("tests/test_strategy.py::test_mixed_precision_computes_in_half_over_fp32_shards_and_reduces_in_fp32",),
    ),
    "7": Plant(
        "parity read from every rank: replica 1's parameters",
        "gradient clipping on the ranks of replica 1 (global rank >= 2 of the 2 x 2 mesh) uses half the max_norm",
        (
            (
                "        torch.nn.utils.clip_grads_with_norm_(params, max_norm, total)\n",
                "        scale = 1.0 if torch.distributed.get_rank() < 2 else 0.5\n"
                "        torch.nn.utils.clip_grads_with_norm_(params, max_norm * scale, total)\n",
            ),
        ),
        ("tests/test_strategy.py::test_training_matches_single_process[llama-accumulate-clipnorm-ac-and-bugs]",),
    ),
    "9a": Plant(
        "no silent skip under make test / CI",
        "the 1 MiB tmpfs cannot be mounted (the disk-full tests skip)",
        (('["mount", "-t", "tmpfs", "-o", "size=1m"', '["false", "-t", "tmpfs", "-o", "size=1m"'),),
        ("tests/test_cli.py::test_disk_full_exits_1_and_leaves_nothing",),
        env=(("FABRIC_HSDP_NO_SKIPS", "1"),),
    ),
    "9b": Plant(
        "cluster tests never skip where SLURM is installed (no CI, no make test)",
        "the cluster's requirements check reports a missing piece",
        (
            (
                "    problems = []\n    if os.geteuid() != 0:",
                "    problems = ['planted: a piece is missing']\n    if os.geteuid() != 0:",
            ),
        ),
        (
            "tests/cluster/test_slurm_launchers.py::test_tasks_per_node_unlike_devices_stops_every_rank_with_one_message",
        ),
        env=(("CI", ""), ("FABRIC_HSDP_NO_SKIPS", "")),
    ),
    "10a": Plant(
        "a resumed run equals the straight one exactly, not to 4 printed decimals",
        "a sharded load restores AdamW's exp_avg_sq rounded through bf16",
        (
            (
                "            set_optimizer_state_dict(self.model, optimizer, tensors[key])\n",
                "            set_optimizer_state_dict(self.model, optimizer, tensors[key])\n"
                "            for entries in optimizer.state.values():\n"
                "                if 'exp_avg_sq' in entries:\n"
                "                    entries['exp_avg_sq'].copy_(entries['exp_avg_sq'].bfloat16().float())\n",
            ),
        ),
        ("tests/test_examples.py::test_train_resumes_from_its_sharded_checkpoint_exactly",),
    ),
    "10b": Plant(
        "a full checkpoint with optimizer state loads under TP (litgpt's fused rows) and with replicas",
        "the full checkpoint's optimizer state ignores the rows tensor parallelism regrouped",
        (
            (
                "                copy_local_part(value, target, fused.get(fqn))\n",
                "                copy_local_part(value, target, None)\n",
            ),
        ),
        ("tests/tensor_parallel/test_checkpoints.py::test_tensor_parallel_checkpoint_loads_exactly_on_other_layouts",),
    ),
    "11": Plant(
        "launch budgets within the test's pytest timeout",
        "launch() takes its timeout as given, whatever the test's pytest timeout leaves",
        (("    return max(1.0, min(timeout, deadline - time.monotonic() - MARGIN))\n", "    return timeout\n"),),
        ("tests/test_helpers.py",),
    ),
    "10c": Plant(
        "timeout and process_group_backend in a launched run",
        "the strategy's timeout never reaches the default process group",
        (("            timeout=self._timeout,\n", "            timeout=default_pg_timeout,\n"),),
        ("tests/checkpoint/test_load_raw.py::test_every_format_and_mode_loads_exactly",),
    ),
    "10d": Plant(
        "reshard_after_forward in a launched run",
        "the strategy's reshard_after_forward never reaches fully_shard",
        (
            (
                "            reshard_after_forward=levers.reshard_after_forward,\n"
                "            mp_policy=mixed_precision_policy(precision),\n",
                "            mp_policy=mixed_precision_policy(precision),\n",
            ),
        ),
        ("tests/test_strategy.py::test_training_matches_single_process[llama-no-reshard]",),
    ),
    "10e": Plant(
        "load_turn_size in a launched run",
        "the strategy's load_turn_size never reaches the turns of load_mode='turns' (one rank per node at a time)",
        (("                turn_size=self.load_turn_size,\n", "                turn_size=1,\n"),),
        ("tests/checkpoint/test_load_raw.py::test_key_errors_strict_and_not_strict_and_a_rank_that_cannot_open",),
    ),
    "23a": Plant(
        "the dry run's report plans with the strategy's levers (#23, #25)",
        "the report's planner side ignores selective AC and sequence parallelism (it planned full AC, no SP, before)",
        (
            (
                "    training = strategy.planner_training(workload)\n",
                "    training = strategy.planner_training(workload)\n"
                "    import dataclasses\n"
                "    training = dataclasses.replace(training, activation_checkpointing_mode='full',"
                " sequence_parallel=False)\n",
            ),
        ),
        ("tests/test_dryrun.py::test_rank_77_of_16x8_with_tensor_parallelism_and_the_scripts_own_save",),
    ),
    "23b": Plant(
        "a dry run's save takes the checkpoint code's path under TP (#23)",
        "the dry run's save reads the state dict through the export hooks (whole litgpt qkv weights on every rank)",
        (
            (
                "    with held_row_order():  # as the strategy's save",
                "    import contextlib\n\n    with contextlib.nullcontext():  # planted; as the strategy's save",
            ),
        ),
        ("tests/test_dryrun.py::test_a_tensor_parallel_save_of_litgpt_writes_this_ranks_shards_only",),
    ),
    "25a": Plant(
        "compiled blocks under tensor parallelism train like eager (#25)",
        "the embedding's asynchronous TP output reaches the compiled block (litgpt's embedding gets no gradient)",
        (("        finish_collectives_before_units(module, units)\n", ""),),
        ("tests/test_levers.py::test_levers_train_like_one_process_and_checkpoint_like_plain[1x4-mesh122]",),
    ),
    "25b": Plant(
        "selective activation checkpointing saves the matmuls (#25)",
        "selective AC saves no op's output (recomputes the matmuls too, like full AC)",
        (("    ops = [getattr(aten, name).default for name in names]\n", "    ops = []\n"),),
        ("tests/test_levers_units.py::test_activation_checkpointing_modes_recompute_what_they_say",),
    ),
    "25d": Plant(
        "compiled transformers blocks share one graph (#25)",
        "compile leaves transformers' KV cache on (each layer recompiles on its layer_idx)",
        (('    disable_kv_cache(module, "torch.compile")\n', ""),),
        ("tests/test_levers.py::test_levers_train_like_one_process_and_checkpoint_like_plain[1x4-mesh122]",),
    ),
    "25e": Plant(
        "compiled blocks under tensor parallelism are one graph each (#25)",
        "every split region gets the dropout seeding, with or without dropout (graph breaks in each block)",
        (("        if not has_dropout(module):\n            continue\n", ""),),
        ("tests/test_levers.py::test_levers_train_like_one_process_and_checkpoint_like_plain[1x4-mesh122]",),
    ),
    "25f": Plant(
        "sequence parallel's first-layer split does not break or recompile the compiled layer (#25)",
        "the split hook is traced by dynamo (weak dictionary: graph breaks)",
        (
            (
                "        module.register_forward_pre_hook(torch.compiler.disable(split), with_kwargs=True)\n",
                "        module.register_forward_pre_hook(split, with_kwargs=True)\n",
            ),
        ),
        ("tests/test_levers.py::test_levers_train_like_one_process_and_checkpoint_like_plain[2x2-mesh212]",),
    ),
    "25g": Plant(
        "a compiled tensor-parallel model run at a second sequence length computes what eager does",
        "sequence parallel's first-layer split keeps the first length it saw (rank 1's part of a shorter one is empty)",
        (
            (
                "            part = whole.redistribute(placements=[Shard(1)]).to_local()"
                ".clone(memory_format=torch.contiguous_format)\n",
                "            part = whole.redistribute(placements=[Shard(1)]).to_local()"
                ".clone(memory_format=torch.contiguous_format)\n"
                "            first = module.__dict__.setdefault('_planted_length', args[0].shape[1])\n"
                "            if first != args[0].shape[1]:\n"
                "                rows, rank = first // device_mesh.size(), device_mesh.get_local_rank()\n"
                "                part = args[0][:, rank * rows : (rank + 1) * rows].contiguous()\n",
            ),
        ),
        ("tests/test_levers.py::test_levers_train_like_one_process_and_checkpoint_like_plain[2x2-mesh212]",),
    ),
    "20a": Plant(
        "a rank that fails while starting ends cleanly (#20's exit 134: an srun task 'Aborted' in CI)",
        "the strategy's exit handler is registered only after the rank-layout check passed",
        (
            ("        atexit.register(self._end_of_process)\n", ""),
            (
                "            mesh=lambda: self._run_topology.mesh_if_built,\n        )\n",
                "            mesh=lambda: self._run_topology.mesh_if_built,\n        )\n"
                "        atexit.register(self._end_of_process)\n",
            ),
        ),
        (
            "tests/test_clean_exit.py::"
            "test_a_rank_that_fails_while_starting_destroys_its_process_group_before_the_interpreter_does",
        ),
    ),
    "19d": Plant(
        "a stopped store host (rank 0) fails the other ranks instead of hanging (#19)",
        "the watchdog does not time its own store calls",
        (
            (
                "            if since is not None and since == seen and time.monotonic() - since > self._timeout:\n",
                "            if False:\n",
            ),
        ),
        ("tests/checkpoint/test_io_watchdog.py::test_a_stopped_store_host_fails_the_other_ranks_naming_the_store",),
    ),
    "19a": Plant(
        "full (one-file) saves are watched by the I/O watchdog (#19)",
        "save_full runs outside the watch: rank 0's stuck write leaves the others in its gathers",
        (
            (
                "        with held_row_order(), self._watchdog.watch(f\"saving checkpoint '{path}'\"):\n"
                "            checkpoint = CheckpointState(state)\n"
                '            if full or self.state_dict_type == "full" or path.suffix == ".safetensors":\n'
                "                save_full(path, checkpoint, filter)  # rank 0 writes; the others wait in its gathers\n"
                "                return\n",
                '        if full or self.state_dict_type == "full" or path.suffix == ".safetensors":  # planted\n'
                "            with held_row_order():\n"
                "                save_full(path, CheckpointState(state), filter)\n"
                "            return\n"
                "        with held_row_order(), self._watchdog.watch(f\"saving checkpoint '{path}'\"):\n"
                "            checkpoint = CheckpointState(state)\n",
            ),
        ),
        (
            "tests/checkpoint/test_io_watchdog.py::test_stalled_rank_fails_every_rank_with_its_file_and_progress"
            "[full-save-fifo-0-writing-/full.pth']",
        ),
    ),
    "19b": Plant(
        "a sharded load allocates a fresh optimizer's state from the checkpoint, no zero step (#19)",
        "the allocation is skipped: DCP steps the optimizer with zero gradients before every cold load",
        (
            (
                "    if optimizer.state:\n        return False\n    paths = ",
                "    if True:  # planted\n        return False\n    paths = ",
            ),
        ),
        ("tests/checkpoint/test_save_load.py::test_resharded_load_is_exact[2-2-False]",),
    ),
    "19c": Plant(
        "a DCP chunk's layout read from its zip directory (#19)",
        "the data start ignores the local header's extra field (the alignment padding)",
        (
            (
                "    return local + _LOCAL.size + name_length + extra_length\n",
                "    return local + _LOCAL.size + name_length\n",
            ),
        ),
        ("tests/checkpoint/test_torch_chunk.py::test_layout_matches_torch_load",),
    ),
    "21a": Plant(
        "the load and save flows go one way down (#21)",
        "the commit in the core calls back into the training path (state.apply_filter) after committing",
        (
            (
                "    log_throughput(verb, path, time.monotonic() - started)\n",
                "    log_throughput(verb, path, time.monotonic() - started)\n"
                "    from fabric_hsdp.checkpoint.training.state import apply_filter\n\n"
                "    apply_filter({}, {})\n",
            ),
        ),
        ("tests/test_callpath.py::test_the_package_flows_go_one_way_down[save]",),
    ),
    "31a": Plant(
        "Fabric's save(filter=) in the one checkpoint state (#31)",
        "the filter is ignored: every entry is saved",
        (("        _apply_filter(key, filter or {}, value, kept)\n", "        kept[key] = value\n"),),
        ("tests/checkpoint/test_save_filter.py",),
    ),
    "35c": Plant(
        "gradient accumulation holds sharded gradients (#35 item 3)",
        "no_backward_sync skips the reduce-scatter too (Lightning's FSDP2 control): unsharded gradients every rank",
        (
            (
                "        unit.set_requires_all_reduce(False, recurse=False)\n",
                "        unit.set_requires_gradient_sync(False, recurse=False)\n",
            ),
            (
                "            unit.set_requires_all_reduce(True, recurse=False)\n",
                "            unit.set_requires_gradient_sync(True, recurse=False)\n",
            ),
        ),
        ("tests/test_gradients.py",),
    ),
    "35d": Plant(
        "a forward without gradients leaves the model sharded (#35 item 4)",
        "no reshard after a no-grad forward: the root unit stays gathered, setup_optimizers refuses the optimizer",
        (("    module.register_forward_hook(_reshard_after_forward_without_gradients)\n", ""),),
        ("tests/test_fsdp.py::test_a_forward_without_gradients_leaves_the_model_sharded",),
    ),
    "35a": Plant(
        "async staging copies straight from the live shards (#35 item 1)",
        "qkv's pieces joined by torch.cat before the copy (a temporary the side stream is not ordered after)",
        (
            (
                "        sources = [local.detach()[piece.start : piece.stop] for piece in mine]\n",
                "        sources = [local.detach()[piece.start : piece.stop] for piece in mine]\n"
                "        sources = [torch.cat(sources)] if len(sources) > 1 else sources\n",
            ),
        ),
        ("tests/checkpoint/test_staging.py::test_staging_copies_straight_from_the_live_shards",),
    ),
    "35e": Plant(
        "bf16-mixed without autocast on top of FSDP2's policy (#35 item 8)",
        "Fabric's MixedPrecision kept: autocast inside every block, logits upcast to fp32",
        (
            (
                '    if type(plugin) is MixedPrecision and plugin.precision == "bf16-mixed":\n',
                '    if False and type(plugin) is MixedPrecision and plugin.precision == "bf16-mixed":\n',
            ),
        ),
        ("tests/test_strategy.py::test_mixed_precision_computes_in_half_over_fp32_shards_and_reduces_in_fp32",),
    ),
    "35f": Plant(
        "the embedding and the norm + head are FSDP units of their own (#35 item 7)",
        "everything outside the blocks stays in the root unit, gathered through the whole step",
        (("    embeddings, tail = outer_units(module, units)\n", "    embeddings, tail = [], []\n"),),
        (
            "tests/test_fsdp.py::test_embedding_and_head_are_units_of_their_own_so_the_embedding_is_freed_after_its_forward",
        ),
    ),
    "35g": Plant(
        "compile + selective AC applies the policy inside the compiled graph (#35 item 5)",
        "activation checkpointing by hooks around the block (the composable API): backward reruns the compiled forward",
        (
            (
                '        child.__class__ = checkpointed_class(type(child), selective=mode == "selective")\n',
                "        from torch.distributed._composable import checkpoint as hooks\n"
                "        policy = selective_checkpoint_contexts\n"
                '        hooks(child, **({"context_fn": policy} if mode == "selective" else {}))\n',
            ),
        ),
        ("tests/test_levers_units.py::test_compiled_blocks_recompute_what_their_mode_says",),
    ),
    "35h": Plant(
        "the GPU session's hand-written torchtitan-style loop compiles its blocks, as torchtitan does (#35)",
        "the hand-written loop's blocks are not compiled: the headline ratio would compare compiled with eager",
        (("        block.compile(**compile_options)\n", "        pass\n"),),
        ("tests/test_gpu_check.py::test_the_prepared_gpu_session_rehearses_end_to_end_on_cpu",),
    ),
    "35i": Plant(
        "async staging: one host block of the chunks' exact size, kept across saves (#35 item 9, review S6)",
        "a buffer allocated per chunk (on CUDA: a pinned block each, rounded up by the caching host allocator)",
        (
            (
                "                self._buffers[key] = own_storage(memory, dtype, shape)\n",
                "                self._buffers[key] = torch.empty(shape, dtype=dtype)\n",
            ),
        ),
        ("tests/checkpoint/test_staging.py::test_staged_chunks_share_one_block_of_their_exact_size_kept_across_saves",),
    ),
    "35j": Plant(
        "async staging: only the next optimizer step waits for the copies (#35 item 9, review S6)",
        "no step waits: the next optimizer step may overwrite shards the side stream has not copied yet",
        (("        if self._step_hook is None:\n", "        if False:\n"),),
        ("tests/checkpoint/test_staging.py::test_the_next_optimizer_step_waits_for_the_copies_and_only_it",),
    ),
    "35k": Plant(
        "float8 tensorwise: float8 all-gather with scales precomputed after each step (#35 item 6)",
        "no precompute after the optimizer step: each layer computes its scale inside the next forward",
        (("            precompute_scales_after_steps(optimizer, self._sharded.modules())\n", "            pass\n"),),
        ("tests/test_float8.py",),
    ),
    "35l": Plant(
        "float8 tensorwise: the weights are all-gathered in float8 (#35 item 6)",
        "tensorwise all-gathers in high precision (torchao's default)",
        (
            (
                "        config = dataclasses.replace(config, enable_fsdp_float8_all_gather=True)\n",
                "        pass\n",
            ),
        ),
        ("tests/test_float8.py",),
    ),
    "35m": Plant(
        "the writing thread binds the rank's device before it waits for the copies (#35 item 2)",
        "ready() synchronizes the copies' event on the writing thread's current device, cuda:0 on every rank",
        (("            torch.cuda.set_device(device)\n", "            pass\n"),),
        (
            "tests/checkpoint/test_staging.py::"
            "test_the_writing_thread_binds_the_ranks_device_before_it_waits_for_the_copies",
        ),
    ),
    "35n": Plant(
        "the background writer reads the host copies with DCP's serial loader (#35 item 2)",
        "DCP's overlapping loader: it syncs the writing thread's current CUDA stream (GPU 0's) for host tensors",
        (("        self.per_thread_copy_ahead = 0\n", "        pass\n"),),
        (
            "tests/checkpoint/test_staging.py::"
            "test_the_writing_thread_binds_the_ranks_device_before_it_waits_for_the_copies",
        ),
    ),
    "33p": Plant(
        "a LoRA fine-tune resumes its adapter-only checkpoint: the model check compares the adapters (#33, #34)",
        "the whole model's tensors are compared with the adapter-only checkpoint: 'holds another model', every resume",
        (
            (
                "if name in adapters} if lora_r else shapes\n",
                "if name in adapters} if False else shapes\n",
            ),
        ),
        (
            "tests/test_lora.py::"
            "test_finetune_example_with_lora_r_keeps_adapter_only_checkpoints_resumes_and_exports[litgpt]",
        ),
    ),
    "33q": Plant(
        "a frozen base needs no weight gradients in the planner's FLOPs (#33)",
        "a frozen weight is counted at 6 FLOPs per token, as if it had a weight gradient",
        (("    return 6 if parameter.trainable else 4\n", "    return 6\n"),),
        (
            "tests/planning/test_lora_plan.py::test_a_frozen_base_needs_no_weight_gradients_in_the_flops[False]",
            "tests/planning/test_lora_plan.py::test_a_frozen_base_needs_no_weight_gradients_in_the_flops[True]",
        ),
    ),
    "34a": Plant(
        "resuming another model's checkpoint names both sides (#34)",
        "no key check before DCP's load: torch's bare 'Missing key in checkpoint state_dict'",
        (
            (
                "_check_model_keys(path, metadata, model_key, tensors[model_key], strict, model_config(model))",
                "None",
            ),
        ),
        ("tests/checkpoint/test_save_load.py::test_resuming_another_models_checkpoint_names_both_sides",),
    ),
    "32a": Plant(
        "hub-layout MoE checkpoints load through transformers' conversion rules (#32 item 1)",
        "raw loads ignore the model family's conversion: the per-expert tensors meet the fused parameters",
        (
            (
                "    load.split_mesh, load.optional, load.module = split_mesh, names.optional, module\n",
                "    load.split_mesh, load.optional, load.module = split_mesh, names.optional, None\n",
            ),
        ),
        (
            "tests/checkpoint/test_moe_checkpoints.py::test_hub_layout_loads_into_hsdp_with_each_rank_reading_its_experts[qwen3_moe-modes0]",
        ),
    ),
    "32b": Plant(
        "a rank reads only the experts its shard holds (#32 items 1 and 4)",
        "a box of stacked experts reads every expert of the layer, then keeps its own (values still right)",
        (
            (
                "        return torch.stack([self.parts[index].read(inner) for index in range(start, start + size)],"
                " self.dim)\n",
                "        return torch.stack([part.read(inner) for part in self.parts], self.dim)"
                ".narrow(self.dim, start, size)\n",
            ),
        ),
        (
            "tests/checkpoint/test_moe_checkpoints.py::test_hub_layout_loads_into_hsdp_with_each_rank_reading_its_experts[mixtral-modes1]",
            "tests/checkpoint/test_moe_checkpoints.py::test_a_box_cutting_through_the_concatenation_reads_only_its_rows",
        ),
    ),
    "32c": Plant(
        "a shard cutting through gate_up_proj's concatenation reads the right rows of each part (#32 item 1)",
        "the part's rows are taken at the concatenation's offsets, not the part's own",
        (
            (
                "                pieces.append(part.read(_replace(box, self.dim, begin - start, end - begin)))\n",
                "                pieces.append(part.read(_replace(box, self.dim,"
                " min(begin, part.shape[self.dim] - end + begin), end - begin)))\n",
            ),
        ),
        ("tests/checkpoint/test_moe_checkpoints.py::test_a_box_cutting_through_the_concatenation_reads_only_its_rows",),
    ),
    "32d": Plant(
        "operations that cannot be read lazily are refused by name (#32 item 1)",
        "no check of the mapping's operations before running them on lazy expressions",
        (("        if type(operation).__name__ not in LAZY_OPERATIONS:\n", "        if False:\n"),),
        ("tests/checkpoint/test_moe_checkpoints.py::test_operations_that_cannot_be_read_lazily_are_refused_by_name",),
    ),
    "32e": Plant(
        "MoE decoder layers are FSDP units with their experts inside (#32 item 2)",
        "the default units are the layers of every nn.ModuleList, litgpt's experts included (one unit per expert)",
        (("                inside.update(id(nested) for nested in child.modules())\n", ""),),
        ("tests/test_moe.py::test_three_steps_match_one_process_with_each_rank_routing_its_own_batch[litgpt_moe]",),
    ),
    "32f": Plant(
        "tensor parallelism on an MoE model is refused saying which sizes work (#32 item 2)",
        "no refusal: the auto plan meets transformers' expert styles",
        (("    refuse_tensor_parallel(model)\n", ""),),
        ("tests/test_moe.py::test_tensor_parallel_auto_plan_is_refused_saying_which_sizes_work",),
    ),
    "32g": Plant(
        "MoE training matches one process, each rank routing its own batch (#32 item 2)",
        "fully_shard gets the shard dim only: the replicas' expert and router gradients are never averaged",
        (
            (
                '    kwargs: dict[str, Any] = {"mesh": mesh, "reshard_after_forward":'
                " settings.reshard_after_forward}\n",
                '    kwargs: dict[str, Any] = {"mesh": mesh["shard"], "reshard_after_forward":'
                " settings.reshard_after_forward}\n",
            ),
        ),
        ("tests/test_moe.py::test_three_steps_match_one_process_with_each_rank_routing_its_own_batch[qwen3_moe]",),
    ),
    "32h": Plant(
        "MoE exports are written in the hub's layout, one tensor per expert (#32 item 3)",
        "convert_checkpoint writes the model's fused experts as they are",
        (("        hub = hub_layout_for_config(checkpoint, renamed, config)\n", "        hub = None\n"),),
        (
            "tests/checkpoint/test_moe_checkpoints.py::"
            "test_sharded_save_resumes_on_another_node_count_and_exports_to_the_hub_layout[qwen3_moe]",
        ),
    ),
    "32i": Plant(
        "each exported expert is its own box of the fused tensor (#32 item 3)",
        "every chunk of a split starts at row 0: each expert exported as expert 0",
        (
            (
                "    return tuple(_Narrowed(part, dim, start, min(step, size - start))"
                " for start in range(0, size, step))\n",
                "    return tuple(_Narrowed(part, dim, 0, min(step, size - start))"
                " for start in range(0, size, step))\n",
            ),
        ),
        (
            "tests/checkpoint/test_moe_checkpoints.py::"
            "test_sharded_save_resumes_on_another_node_count_and_exports_to_the_hub_layout[mixtral]",
        ),
    ),
    "32j": Plant(
        "the planner counts MoE total and active parameters (#32 item 5)",
        "every expert counted as active",
        (
            (
                '        total += numel * top_k // experts if ".experts." in name else numel\n',
                "        total += numel\n",
            ),
        ),
        ("tests/planning/test_moe_counts.py::test_total_and_active_parameters_of_a_moe_model",),
    ),
    "32k": Plant(
        "a torch function the lazy expressions cannot apply is refused by name (#32 item 1)",
        "unknown torch functions fall through to a missing handler (a bare TypeError)",
        (("        if handler is None:\n", "        if False:\n"),),
        (
            "tests/checkpoint/test_moe_checkpoints.py::"
            "test_a_torch_function_the_expressions_cannot_apply_lazily_is_refused_by_name",
        ),
    ),
    "34b": Plant(
        "the planner keeps headroom for what it estimates (#34)",
        "a row fits on its total with the activation estimate as is (70.7 of 72.0 GB on an estimate)",
        (("        fits = with_headroom(memory).total <= usable\n", "        fits = memory.total <= usable\n"),),
        ("tests/planning/test_expert.py::test_headroom_for_the_estimated_activations",),
    ),
    "34c": Plant(
        "every layout runs one stated global batch (#34)",
        "each row runs one micro-batch per data-parallel rank: TP rows run T times fewer tokens per step",
        (
            (
                "training, layout, batch, usable, adapt, weigh)",
                "training, layout, layout.data_parallel_size * training.workload.micro_batch_size, usable, adapt,"
                " weigh)",
            ),
        ),
        (
            "tests/planning/test_expert.py::test_every_row_runs_the_one_stated_global_batch",
            "tests/planning/test_expert.py::test_tensor_parallelism_runs_the_same_tokens_per_step",
            "tests/planning/test_expert.py::test_the_recommendation_is_the_experts",
        ),
    ),
    "34d": Plant(
        "every micro-batch gathers the model again (#34)",
        "gradient accumulation's micro-batches are free: FSDP traffic counted once per optimizer step",
        (
            (
                "    gathers = 1 if training.keep_gathered_while_accumulating else accumulation_steps\n",
                "    gathers = 1\n",
            ),
        ),
        ("tests/planning/test_expert.py",),
    ),
    "34e": Plant(
        "the output says why the winner won (#34)",
        "the recommended line names the winner's figure only, not what the other TP sizes cost",
        (("    if alternatives:\n", "    if False:\n"),),
        ("tests/planning/test_expert.py::test_the_output_says_why_the_winner_won",),
    ),
    "34f": Plant(
        "memory freed by TP buys a larger micro-batch (#34)",
        "every row runs micro-batches of 1 and accumulates the rest",
        (
            (
                "    sizes = [size for size in range(sequences_per_rank, 0, -1) if sequences_per_rank % size == 0]\n",
                "    sizes = [1]\n",
            ),
        ),
        (
            "tests/planning/test_expert.py::test_memory_freed_by_tensor_parallelism_buys_micro_batch_and_fewer_recomputes",
            "tests/planning/test_expert.py::test_headroom_for_the_estimated_activations",
        ),
    ),
    "34g": Plant(
        "memory freed by TP buys fewer recomputes (#34)",
        "activation checkpointing, once allowed, stays on in every row",
        (
            (
                '    return ["none", "selective", *([user] if isinstance(user, int) else []), "full"]\n',
                '    return ["selective", *([user] if isinstance(user, int) else []), "full"]\n',
            ),
        ),
        (
            "tests/planning/test_expert.py::test_memory_freed_by_tensor_parallelism_buys_micro_batch_and_fewer_recomputes",
            "tests/planning/test_expert.py::test_the_recommendation_is_the_experts",
        ),
    ),
    "34h": Plant(
        "inspect shows small extras' values (#34)",
        "an extra's type and size only: `step` shows no value",
        (('    if small:\n        entry["value"] = value\n', '    if False:\n        entry["value"] = value\n'),),
        (
            "tests/test_cli.py::test_convert_and_inspect",
            "tests/checkpoint/test_convert.py::test_inspect_reads_metadata_only",
        ),
    ),
    "34i": Plant(
        "dryrun --max_steps 0 saves nothing unless asked (#34)",
        "the dry run's own save after the limit runs with --max_steps 0 too (3.1 GiB at 70B for a set-up run)",
        (
            (
                "                save_after_stop = max_steps > 0 and not no_compute\n",
                "                save_after_stop = not no_compute\n",
            ),
        ),
        ("tests/test_dryrun.py::test_rank_5_of_2x4_loads_its_shard_stops_after_max_steps_and_saves_into_scratch",),
    ),
    "34j": Plant(
        "the dry run compares the plan with the training step's forward (#34)",
        "the first forward seen, a validation batch under no_grad, sets the planned workload",
        (
            (
                "        training = torch.is_grad_enabled() and module.training\n",
                "        training = True\n",
            ),
        ),
        ("tests/test_dryrun.py::test_the_plan_is_compared_with_the_training_forward_not_a_validation_one",),
    ),
    "32m": Plant(
        "the activation estimate of an MoE layer follows the routed tokens (#32, plan and dry run)",
        "each token is counted through one expert, not its top-k",
        (
            (
                "        mlp = dims.experts_per_token * (3 * hidden + 4 * dims.expert_intermediate_size) + experts\n",
                "        mlp = (3 * hidden + 4 * dims.expert_intermediate_size) + experts\n",
            ),
        ),
        (
            "tests/planning/test_moe_plan.py::test_moe_layer_estimate_within_15_percent_of_saved_tensors[qwen3_moe-32-8-dtype1]",
            "tests/planning/test_moe_plan.py::test_activations_follow_the_routed_tokens",
        ),
    ),
    "32n": Plant(
        "an expert's width is Qwen3-MoE's moe_intermediate_size, not its dense intermediate_size (#32)",
        "the expert width is always the config's intermediate_size",
        (
            (
                "    width = dims.expert_intermediate_size or dims.intermediate_size\n",
                "    width = dims.intermediate_size\n",
            ),
        ),
        ("tests/planning/test_moe_plan.py::test_dims_of_published_configs",),
    ),
    "32o": Plant(
        "model FLOPs per token count the active parameters of an MoE model (#32)",
        "every expert counted in the FLOPs per token",
        (
            (
                "        routed_flops = routed_flops * dims.experts_per_token // dims.num_experts\n",
                "        routed_flops = routed_flops\n",
            ),
        ),
        (
            "tests/planning/test_moe_plan.py::test_model_flops_count_the_active_parameters[qwen3_moe]",
            "tests/planning/test_moe_plan.py::test_model_flops_count_the_active_parameters[litgpt_moe]",
        ),
    ),
    "32p": Plant(
        "memory and all-gathers hold every expert's shard, not the active ones (#32)",
        "the FSDP units' sizes leave out the fused expert tensors (3-D)",
        (
            (
                "                numels = [local_numel(p, fsdp_size, tensor_parallel_size, expert_parallel_size)"
                " for p in parameters]\n",
                "                numels = [local_numel(p, fsdp_size, tensor_parallel_size, expert_parallel_size)"
                " if len(p.shape) < 3 else (0, 0) for p in parameters]\n",
            ),
        ),
        ("tests/planning/test_moe_plan.py::test_memory_and_all_gathers_hold_every_expert",),
    ),
    "32q": Plant(
        "a model's MoE layers get the routed activation estimate (#32)",
        "the planner estimates every layer as a dense one",
        (("    expert_layers = dims.expert_layers or 0\n", "    expert_layers = 0\n"),),
        ("tests/planning/test_moe_plan.py::test_activations_follow_the_routed_tokens",),
    ),
    "32r": Plant(
        "the planner offers no tensor-parallel layout for an MoE model, as the strategy refuses them (#32)",
        "MoE models' tensor-parallel layouts are planned (with split dims guessed by name)",
        (
            (
                "        if self.dims.num_experts:  # the strategy refuses",
                "        if False:  # the strategy refuses",
            ),
        ),
        (
            "tests/planning/test_moe_plan.py::"
            "test_tensor_parallel_layouts_of_a_moe_model_are_refused_as_the_strategy_refuses_them",
        ),
    ),
    "33a": Plant(
        "a base checkpoint loads into a LoRA model by the base names (#33)",
        "the wrapper's base-layer name (peft's base_layer, litgpt's linear) kept in the names matched",
        (
            (
                "            if part != wrapper.inner:\n                kept.append(part)\n",
                "            kept.append(part)\n",
            ),
        ),
        ("tests/test_lora.py::test_lora_base_loads_strict_and_trains_like_one_process",),
    ),
    "33b": Plant(
        "adapters made real from meta get their library's init (#33)",
        "no adapter init after materialisation: peft's lora_B keeps the transformers init (not zero)",
        (("    initialize_adapters(module, owners)  #", "    pass  #"),),
        ("tests/test_lora.py::test_lora_base_loads_strict_and_trains_like_one_process",),
    ),
    "33c": Plant(
        "adapters are optional in a strict raw load of the base (#33)",
        "adapters counted as missing: a strict load of the base checkpoint raises",
        (("    match.missing = [key for key in match.missing if key not in optional]\n", ""),),
        ("tests/test_lora.py::test_lora_base_loads_strict_and_trains_like_one_process",),
    ),
    "33d": Plant(
        "the peft export holds peft's own key names (#33)",
        "the adapters handed to peft's save_pretrained without the base_model.model. prefix",
        (
            (
                "module.save_pretrained(str(output), state_dict=adapters)",
                "module.save_pretrained(str(output), state_dict={k.removeprefix('base_model.model.'): v for k, v in"
                " adapters.items()})",
            ),
        ),
        ("tests/test_lora.py::test_peft_export_loads_in_peft_and_gives_the_trained_logits",),
    ),
    "33e": Plant(
        "LoRA is refused under tensor parallelism, with the reason (#33)",
        "no refusal: tensor parallelism would split base layers but not their adapters",
        (("    if tensor_parallel:\n        raise ValueError(", "    if False:\n        raise ValueError("),),
        ("tests/test_lora.py::test_lora_is_refused_under_tensor_parallelism_with_the_reason",),
    ),
    "33f": Plant(
        "a checkpoint of the LoRA model itself (wrapped names) loads back (#33)",
        "checkpoint keys not renamed like the model's: a full save's base_layer names match nothing",
        (
            (
                "        return None if renamed is None else load_name.get(renamed, renamed)\n",
                "        return renamed\n",
            ),
        ),
        ("tests/test_lora.py::test_lora_adapter_only_checkpoint_is_small_and_resumes_on_another_node_count",),
    ),
    "33g": Plant(
        "a frozen base costs only its bf16 shards under bf16-mixed (#33)",
        "frozen parameters kept in their fp32 build dtype: an fp32 master copy of a base that never changes",
        (("    hold_frozen_in_compute_dtype(module, settings.mp_policy)  #", "    pass  #"),),
        ("tests/test_lora.py::test_a_frozen_base_is_held_in_bf16_under_bf16_mixed_while_adapters_train_in_fp32",),
    ),
    "33h": Plant(
        "the planner counts a frozen base without gradients or optimizer state (#33)",
        "every parameter counted as trainable: gradients and AdamW state for the frozen base too",
        (
            (
                'parameters.append(ParameterShape(name, shape, match.group(1) if match else "", split, name not in'
                " frozen))",
                'parameters.append(ParameterShape(name, shape, match.group(1) if match else "", split, True))',
            ),
        ),
        ("tests/test_lora.py::test_the_planner_counts_a_frozen_base_without_gradients_or_optimizer_state",),
    ),
    "33i": Plant(
        "examples/finetune.py --lora_r keeps adapter-only checkpoints (#33)",
        "the adapter filter left out of the periodic saves: every checkpoint holds the whole frozen base",
        (("        fabric.save(path, state, filter=adapters_only)\n", "        fabric.save(path, state)\n"),),
        ("tests/test_lora.py::test_finetune_example_with_lora_r_keeps_adapter_only_checkpoints_resumes_and_exports",),
    ),
    "33j": Plant(
        "the merged export folds the trained adapters into the base (#33)",
        "the litgpt delta dropped when a query/key/value subset is adapted: qkv written as the base's",
        (
            (
                "            return layer.get_lora_AB()\n",
                "            return None if not all(getattr(layer, 'enable_lora', [True])) else layer.get_lora_AB()\n",
            ),
        ),
        ("tests/test_lora.py::test_merged_export_equals_the_librarys_own_merge_and_loads_as_the_base_model",),
    ),
    "33k": Plant(
        "a merged export that fails ends every rank with the error (#33)",
        "the other ranks leave rank 0's request loop at the failure: rank 0's end-of-export message finds them in"
        " the failure exchange, and every rank waits",
        (
            (
                "                if failed is None:  # after a failure, follow rank 0 to its end (it fails at the same"
                " tensor)\n                    try:\n                        _merged(*entries[order[index]])\n",
                "                _merged(*entries[order[index]])\n                if False:\n                    try:\n"
                "                        pass\n",
            ),
        ),
        ("tests/test_lora.py::test_a_merge_that_fails_ends_every_rank_with_the_error",),
    ),
    "33l": Plant(
        "peft's copies of base modules (modules_to_save) refused on meta (#33)",
        "no check: the copy keeps the values of no checkpoint, silently",
        (("    _refuse_copies_of_base_modules(module)\n", ""),),
        ("tests/test_lora.py::test_peft_modules_to_save_is_refused_on_meta_with_what_works",),
    ),
    "33m": Plant(
        "two wrapped names for one base name are refused (#33)",
        "no check: one of the two tensors is silently left out of the load",
        (("    if len(set(load_name.values())) != len(load_name):\n", "    if False:\n"),),
        ("tests/test_lora.py::test_two_tensors_with_one_base_name_are_refused_as_ambiguous",),
    ),
    "33n": Plant(
        "fabric-hsdp plan --lora_r counts the base frozen and the adapters as peft and litgpt make them (#33)",
        "the base left trainable: gradients and AdamW state planned for the whole 70B, not the adapters only",
        (
            (
                "    parameters = [replace(p, trainable=False) for p in model.parameters]\n",
                "    parameters = list(model.parameters)\n",
            ),
        ),
        (
            "tests/planning/test_lora_plan.py::test_adapters_of_a_transformers_config_are_peft_s_own",
            "tests/planning/test_lora_plan.py::test_the_lora_plan_holds_what_the_strategy_measures_per_rank",
        ),
    ),
    "33o": Plant(
        "a QLoRA base (bitsandbytes 4-bit) is refused at setup_module with the reason and what works (#33)",
        "no check: FSDP2 shards the packed 4-bit weights like any parameter, cast as numbers under bf16-mixed",
        (("        refuse_quantized_base(module, device)\n", ""),),
        ("tests/test_qlora.py::test_a_4bit_base_is_refused_on_cpu_on_every_rank_with_the_reason_and_what_works",),
    ),
    "34o": Plant(
        "a package error ends a launched job with one line on rank 0 (#34)",
        "no excepthook: every rank prints its own traceback of the package's ValueError",
        (
            (
                "        sys.excepthook = PackageErrorHook(sys.excepthook)\n",
                "        pass\n",
            ),
        ),
        ("tests/test_errors.py::test_a_package_error_ends_the_job_with_one_line_on_rank_zero",),
    ),
    "34p": Plant(
        "the other ranks leave the package error to rank 0 (#34)",
        "every rank prints the one line (N lines for N ranks), as if rank 0's word were never awaited",
        (
            (
                "        if rank != 0 and _rank_zero_reported():\n",
                "        if rank != 0 and not _rank_zero_reported():\n",
            ),
        ),
        ("tests/test_errors.py::test_a_package_error_ends_the_job_with_one_line_on_rank_zero",),
    ),
    "34q": Plant(
        "the fine-tune example resumes only a checkpoint of its own model (#34)",
        "no model check before the resume: DCP's key check names tensors, not the two models",
        (
            (
                "        note = check_same_model(checkpoint, checkpoint_dir, saved, tied, chosen=",
                "        note = None and check_same_model(checkpoint, checkpoint_dir, saved, tied, chosen=",
            ),
        ),
        ("tests/test_examples.py::test_finetune_refuses_to_resume_another_models_checkpoint_and_names_both",),
    ),
    "34r": Plant(
        "an unwritable save directory is found at start-up (#34)",
        "the start-up check does nothing: the unwritable --out_dir is found at the first save, after the steps",
        (
            (
                "            check_writable(directory)\n",
                "            pass\n",
            ),
        ),
        ("tests/test_examples.py::test_finetune_stops_before_step_1_when_out_dir_is_unwritable",),
    ),
    "34s": Plant(
        "FSDP2's view warning is hidden where it is known harmless: TP's local logits (#34)",
        "no filter: every TP run warns that the head's to_local() view 'can cause backward to fail'",
        (
            (
                "        hide_harmless_view_warning(module)  #",
                "        pass  #",
            ),
        ),
        ("tests/tensor_parallel/test_training.py::test_the_harmless_view_warning_of_tp_logits_is_not_shown",),
    ),
    "34t": Plant(
        "a user's set-up brings no torchao (#34)",
        "`make setup` (and so `make main`) installs the test extras, torchao with them: every process that imports"
        " transformers logs torchao's 'Failed to load ..._C_mxfp8...so' and two torch deprecation warnings",
        (
            (
                '-e ".[examples]" $(PINS)',
                '-e ".[test]" $(PINS)',
            ),
        ),
        ("tests/test_install.py",),
    ),
    "34u": Plant(
        "the examples say each fact of the job once (#34)",
        "facts printed on every node's local rank 0, as fabric.print does: one copy per node",
        (
            (
                "    if fabric.global_rank == 0:\n        print(message, flush=True)\n",
                "    if fabric.local_rank == 0:\n        print(message, flush=True)\n",
            ),
        ),
        ("tests/test_examples.py::test_finetune_says_each_fact_of_the_job_once",),
    ),
    "34v": Plant(
        "ranks waiting in the rendezvous for a node that never started say so (#34)",
        "no notice: the ranks that started wait silently until the rendezvous times out",
        (
            (
                "    timer = threading.Timer(RENDEZVOUS_NOTICE, say) if local_rank == 0 else None\n",
                "    timer = None\n",
            ),
        ),
        ("tests/test_distributed.py::test_ranks_waiting_for_a_node_that_never_started_say_so_once_per_node",),
    ),
    "34w": Plant(
        "a node waiting in torchrun's rendezvous under `fabric-hsdp run` says so (#34)",
        "the notice is never given: node 0 stays silent for torchrun's whole 600 s rendezvous",
        (
            (
                "        if _started_processes() is not False:\n",
                "        if _started_processes() is not None:\n",
            ),
        ),
        ("tests/test_run.py::test_a_node_waiting_for_the_others_in_torchruns_rendezvous_says_so",),
    ),
    "44a": Plant(
        "a raw load that fits no tensor fails, strict or not (#44)",
        "the zero-overlap check is gone: strict=False of a peft adapter file into the base model loads nothing",
        (
            (
                "    if message and len(mismatched) == len(match.mapping):\n",
                "    if False:\n",
            ),
        ),
        (
            "tests/checkpoint/test_mismatched_checkpoints.py::test_a_peft_adapter_file_into_the_base_model_is_named_adapter_only_and_loads_nothing_even_if_not_strict",
        ),
    ),
    "44b": Plant(
        "a sharded load that fits no tensor fails, strict or not (#44)",
        "the zero-overlap check is gone: an adapter-only checkpoint loads into the full model with strict=False",
        (
            (
                "    if message is not None and not fits:\n",
                "    if False:\n",
            ),
        ),
        (
            "tests/checkpoint/test_mismatched_checkpoints.py::test_an_adapter_only_checkpoint_into_the_full_model_fails_with_why_and_adapter_helpers_see_fabrics_module",
        ),
    ),
    "44c": Plant(
        "an adapter-only checkpoint is named as one (#44)",
        "adapter names are not recognised: the generic 'Pass strict=False' hint comes back",
        (
            (
                '    return any(part in _ADAPTER_PARTS for part in key.split("."))\n',
                "    return False\n",
            ),
        ),
        (
            "tests/checkpoint/test_mismatched_checkpoints.py::test_a_peft_adapter_file_into_the_base_model_is_named_adapter_only_and_loads_nothing_even_if_not_strict",
        ),
    ),
    "44d": Plant(
        "another model's checkpoint is named by model_type (#44)",
        "the checkpoint's config.json is never found",
        (
            (
                '    for name in ("config.json", "model_config.yaml"):\n',
                "    for name in ():\n",
            ),
        ),
        (
            "tests/checkpoint/test_mismatched_checkpoints.py::test_another_models_hub_directory_is_named_as_another_model",
            "tests/checkpoint/test_mismatched_checkpoints.py::test_another_moe_familys_hub_directory_is_named_as_another_model",
        ),
    ),
    "44e": Plant(
        "a config that differs names its field (#44)",
        "integer fields are not compared: the vocab_size of the checkpoint's config is never named",
        (
            (
                '        if name == "tie_word_embeddings" or (type(value) is int and type(saved[name]) is int):\n',
                '        if name == "tie_word_embeddings":\n',
            ),
        ),
        (
            "tests/checkpoint/test_mismatched_checkpoints.py::test_a_checkpoint_of_another_vocabulary_size_names_the_config_field",
        ),
    ),
    "44f": Plant(
        "convert refuses a config whose model lacks the checkpoint's tensors (#44)",
        "the config is not checked: OLMoE exported with Mistral's config",
        (
            (
                "            refuse_config_that_does_not_fit(checkpoint, renamed, config)\n",
                "            pass\n",
            ),
        ),
        (
            "tests/checkpoint/test_mismatched_checkpoints.py::test_convert_refuses_a_config_of_another_model_and_says_which_layout_it_writes",
        ),
    ),
    "44g": Plant(
        "adapter helpers see the module Fabric returns (#44)",
        "Fabric's wrapper is not unwrapped: adapter_keys of the set-up model is []",
        (
            (
                "    return module.module if isinstance(module, _FabricModule) else module\n",
                "    return module\n",
            ),
        ),
        (
            "tests/checkpoint/test_mismatched_checkpoints.py::test_an_adapter_only_checkpoint_into_the_full_model_fails_with_why_and_adapter_helpers_see_fabrics_module",
        ),
    ),
    "44h": Plant(
        "every node's log ends with the reason (#44)",
        "ranks other than 0 write no error file: node 1's torchrun has no reason to give",
        (
            (
                "            _tell_torchrun(error_line(error))  # the other nodes' torchrun summaries name the reason",
                "            pass  # planted",
            ),
        ),
        ("tests/test_run.py::test_every_node_of_a_failed_job_ends_its_log_with_the_reason_in_one_line",),
    ),
    "44i": Plant(
        "a save whose filter keeps no tensor of the model fails before writing (#44)",
        "the check is gone: a checkpoint without the model is written",
        (
            (
                "        if self.model_key not in kept:\n",
                "        if False:\n",
            ),
        ),
        (
            "tests/checkpoint/test_mismatched_checkpoints.py::test_an_adapter_only_checkpoint_into_the_full_model_fails_with_why_and_adapter_helpers_see_fabrics_module",
        ),
    ),
    "44j": Plant(
        "a sharded load with strict=False says what it left (#44)",
        "the skipped tensors are not said",
        (
            (
                "    if match.missing or match.unexpected:  # strict=False, as the raw loads say it\n",
                "    if False:\n",
            ),
        ),
        (
            "tests/checkpoint/test_mismatched_checkpoints.py::test_an_adapter_only_checkpoint_into_the_full_model_fails_with_why_and_adapter_helpers_see_fabrics_module",
        ),
    ),
    "44k": Plant(
        "convert refuses a key map that drops every tensor (#44)",
        "the check is gone: an output of 0 tensors is written",
        (
            (
                "        if dropped and not renamed:\n",
                "        if False:\n",
            ),
        ),
        ("tests/checkpoint/test_mismatched_checkpoints.py::test_convert_refuses_a_key_map_that_drops_every_tensor",),
    ),
    "40a": Plant(
        "a filtered save dry-runs as filtered (#40 item 2)",
        "the dry run drops the script's filter: an adapter-only LoRA save is dry-run as a whole-model save",
        (
            (
                'filter = kwargs.get("filter")  # Fabric passes save_checkpoint(path=, state=, filter=)',
                "filter = None",
            ),
        ),
        ("tests/test_dryrun.py::test_an_adapter_only_save_dry_runs_as_adapter_only",),
    ),
    "46a": Plant(
        "an async save holds at most 1/R of the rank's state in host memory, measured by the process (#46 item 0)",
        "the staged chunks handed to DCP as views of the whole staging block: DCP's writer clones every one and keeps"
        " the clones until the file is closed (1.0x of the state at R = 2)",
        (
            (
                "    return torch.from_numpy(flat.numpy()).view(dtype).view(shape)",
                "    return memory.view(dtype).view(shape)",
            ),
        ),
        ("tests/checkpoint/test_staging.py::test_an_async_save_holds_at_most_its_share_of_the_state_in_host_memory",),
    ),
    "46b": Plant(
        "each staged piece of a TP-regrouped chunk is written from the block without a copy (#46 item 0)",
        "a piece handed to DCP as a row range of its chunk's buffer: DCP's writer clones it",
        (("        return own_storage(rows, rows.dtype, rows.shape)\n", "        return rows\n"),),
        ("tests/checkpoint/test_staging.py::test_each_staged_piece_is_written_from_the_block_without_a_copy",),
    ),
    "46c": Plant(
        "each staged chunk's buffer has a storage of its own bytes in the one block (#46 item 0)",
        "a plain tensor's buffer (e.g. a 0-d entry) is a view of the whole block: DCP's writer clones it",
        (
            (
                "                self._buffers[key] = own_storage(memory, dtype, shape)\n",
                "                self._buffers[key] = memory.view(dtype).view(shape)\n",
            ),
        ),
        ("tests/checkpoint/test_staging.py::test_staged_chunks_share_one_block_of_their_exact_size_kept_across_saves",),
    ),
    "46d": Plant(
        "a module that skips itself at collection fails under make test / CI (#46 item 5)",
        "collection reports are left alone: a module-level skip passes under FABRIC_HSDP_NO_SKIPS=1",
        (("    if report.skipped and skips_are_failures():\n", "    if False:\n"),),
        ("tests/test_helpers.py::test_a_module_that_skips_itself_at_collection_fails_under_make_test",),
    ),
    "46e": Plant(
        "a hung test ends, named, when the session's time is up (#46 item 5)",
        "each test keeps its own timeout: a hang holds the run past --session-timeout, checked only between tests",
        (
            (
                "    if _session_deadline is not None and (deadline is None or _session_deadline < deadline):\n",
                "    if False:\n",
            ),
        ),
        ("tests/test_helpers.py::test_a_hung_test_is_ended_with_its_name_when_the_sessions_time_is_up",),
    ),
    "46f": Plant(
        "a launch whose port another process took after free_port() starts again on another (#46 item 5)",
        "no new attempt: rank 0 fails with EADDRINUSE and the launch fails",
        (("        if not _lost_the_port(result, port):\n", "        if True:\n"),),
        ("tests/test_helpers.py::test_a_launch_whose_port_another_process_took_starts_again_on_another",),
    ),
    "46v1": Plant(
        "the dry run's plan validator answers what torch's own answers for a valid plan (#46 item 3)",
        "the stand-in answers True, the answer of torch < 2.13: torch >= 2.13 reads it as a list of errors",
        (
            (
                "    return lambda *args, **kwargs: valid\n",
                "    return lambda *args, **kwargs: True\n",
            ),
        ),
        ("tests/test_versions.py::test_the_dry_runs_plan_validator_passes_a_plan_torchs_own_refuses",),
        expect="test_the_dry_runs_plan_validator_passes_a_plan_torchs_own_refuses",
    ),
    "46v2": Plant(
        "a storage's byte size from a meta load, on every release (#46 item 3)",
        "always divided by the element size (torch 2.8's correction applied on releases that need none)",
        (
            (
                "    return nbytes if _meta_load_sets_offsets() else nbytes // tensor.element_size()\n",
                "    return nbytes // tensor.element_size()\n",
            ),
        ),
        ("tests/checkpoint/test_sources.py::test_read_slice_reads_only_the_box",),
        expect="test_read_slice_reads_only_the_box",
    ),
    "46o1": Plant(
        "a rank's mesh coordinates: tensor-parallel peers are consecutive ranks (#46 item 3)",
        "shard and tensor coordinates swapped",
        (
            (
                "        return (replica, *divmod(position, self.tensor_parallel_size))\n",
                "        return (replica, *reversed(divmod(position, self.tensor_parallel_size)))\n",
            ),
        ),
        ("tests/test_topology.py::test_tensor_parallel_peers_are_consecutive_ranks_of_one_node",),
        expect="assert [topology.coordinates(rank) for rank in range(8)] ==",
    ),
    "46k1": Plant(
        "key_map prefix rules: the longest prefix wins (#46 item 3)",
        "the shortest prefix wins",
        (
            (
                "        rules = sorted(spec.items(), key=lambda rule: len(rule[0]), reverse=True)\n",
                "        rules = sorted(spec.items(), key=lambda rule: len(rule[0]))\n",
            ),
        ),
        ("tests/checkpoint/test_keys.py::test_make_key_map_specs",),
        expect="test_make_key_map_specs",
    ),
    "46k2": Plant(
        "wrapper prefixes are stripped only when unambiguous (#46 item 3)",
        "an ambiguous name is paired with the first checkpoint key that strips to it",
        (
            (
                "            if len(keys) == 1 and len(by_name.get(name, ())) == 1:\n",
                "            if len(keys) == 1 and by_name.get(name):\n",
            ),
        ),
        ("tests/checkpoint/test_keys.py::test_wrapper_stripping_is_skipped_when_ambiguous",),
        expect="test_wrapper_stripping_is_skipped_when_ambiguous",
    ),
    "46f1": Plant(
        "an output that fails is not left behind (#46 item 3)",
        "the pending sibling of a failed atomic output stays on disk",
        (
            (
                "    finally:\n        remove_path(pending)\n",
                "    finally:\n        pass\n",
            ),
        ),
        ("tests/checkpoint/test_writers.py::test_atomic_output_removes_everything_on_failure",),
        expect="test_atomic_output_removes_everything_on_failure",
    ),
    "46r1": Plant(
        "the format readers read exactly the box asked for (#46 item 3)",
        "a box of whole rows is read from the tensor's first row, whatever row it starts at",
        (
            (
                "        readinto(fd, out, offset + first_row * row_bytes, file_name=file_name)\n",
                "        readinto(fd, out, offset, file_name=file_name)\n",
            ),
        ),
        ("tests/checkpoint/test_sources.py::test_read_slice_reads_only_the_box",),
        expect='assert torch.equal(source.read_slice("w", box), weight[box]), (path, box)',
    ),
    "46s1": Plant(
        "split_replica_reads: each replica reads its own part of the rows (#46 item 3)",
        "every replica reads the first part: the gathered shard repeats it",
        (
            (
                "    start, stop = replica * rows, (replica + 1) * rows\n",
                "    start, stop = 0, rows\n",
            ),
        ),
        ("tests/checkpoint/test_raw_replica_split.py::test_raw_load_reads_each_byte_once_per_replica_group",),
        expect="test_raw_load_reads_each_byte_once_per_replica_group",
    ),
    "46l1": Plant(
        "the launcher is read from the environment: srun's tasks per node (#46 item 3)",
        "SLURM's tasks-per-node notation ('2(x2)') is not read: ranks per node unknown, nodes unknown",
        (
            (
                "    return counts.pop() if len(counts) == 1 else None\n",
                "    return None\n",
            ),
        ),
        ("tests/test_launchers.py::test_the_innermost_launcher_is_detected",),
        expect="test_the_innermost_launcher_is_detected",
    ),
    "46p1": Plant(
        "a preemption signal on one rank stops every rank at the same step (#46 item 3)",
        "each rank answers its own flag: the ranks that got no signal train on",
        (
            (
                "            dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self._cpu_group())\n",
                "            pass\n",
            ),
        ),
        ("tests/test_long_run.py::test_a_signal_requests_a_stop_that_every_rank_agrees_on_at_the_step_boundary",),
        expect="test_a_signal_requests_a_stop_that_every_rank_agrees_on_at_the_step_boundary",
    ),
    "43a": Plant(
        "the GPU session's preflight holds its 30 s: a hung nvidia-smi is ended and said so (#43 item 1)",
        "nvidia-smi is waited for without a timeout: a hung driver holds the whole run",
        (
            (
                "smi.communicate(timeout=max(1.0, NVIDIA_SMI - (time.monotonic() - start)))[0]\n",
                "smi.communicate()[0]\n",
            ),
        ),
        ("tests/test_gpu_check.py::test_the_preflight_stops_a_run_that_cannot_work_within_30_s_and_says_why",),
    ),
    "43b": Plant(
        "without the C compiler Triton needs, both throughput sides run without compile (#43 item 1)",
        "the compiler check ignores $CC (Triton's first choice): gcc on PATH passes while Triton would fail",
        (
            (
                '    chosen = env.get("CC") or shutil.which("gcc", path=env.get("PATH"))',
                '    chosen = shutil.which("gcc", path=env.get("PATH"))',
            ),
        ),
        ("tests/test_gpu_check.py::test_the_preflight_stops_a_run_that_cannot_work_within_30_s_and_says_why",),
    ),
    "43c": Plant(
        "a throughput variant ended mid-way keeps its whole log in its own file (#43 item 2)",
        "the output is captured, as subprocess.run(capture_output=True) did, and lost when the timeout ends it",
        (
            (
                "subprocess.Popen(command, stdout=output, stderr=subprocess.STDOUT, env=env, cwd=cwd)\n",
                "subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env, cwd=cwd)\n",
            ),
        ),
        ("tests/test_gpu_check.py::test_a_throughput_variant_ended_at_its_deadline_leaves_its_log_and_no_process",),
    ),
    "43d": Plant(
        "a timed-out torchrun is ended with its workers (#43 item 9)",
        "only torchrun is killed (SIGKILL, as before): its workers, in sessions of their own, keep running",
        (
            ("    tree = descendants(process.pid)\n", "    tree: list[int] = []\n"),
            ("    process.send_signal(signal.SIGTERM)\n", "    process.kill()\n"),
        ),
        ("tests/test_gpu_check.py::test_a_timed_out_torchrun_is_ended_with_its_workers",),
    ),
    "43e": Plant(
        "gloo's sum-and-divide is keyed on the backend, not the device (#43 item 8)",
        "keyed on the device, as before: two ranks on one GPU over gloo would ask gloo to average",
        (
            (
                "    return any(map(versions.gloo_reduces_average_as_sum, backends))\n",
                '    return mesh.device_type == "cpu"\n',
            ),
        ),
        ("tests/test_versions.py::test_gloo_reductions_are_summed_whatever_tensors_gloo_carries",),
    ),
    "43f": Plant(
        "MFU counts causal attention (#43 item 7)",
        "full attention's 12 x layers x dim x sequence: MFU ~13 % high at the 1.3B size",
        (
            (
                "    return 6 * non_embedding + 6 * config.n_layers * config.dim * config.max_seq_len\n",
                "    return 6 * non_embedding + 12 * config.n_layers * config.dim * config.max_seq_len\n",
            ),
        ),
        ("tests/test_gpu_check.py::test_mfu_counts_causal_attention",),
    ),
    "43g": Plant(
        "the throughput ratio is printed only when both sides compiled alike (#43 item 5)",
        "no check: a baseline with graph breaks gives a ratio that flatters",
        (
            (
                '    if any(ours[key] != baseline[key] for key in keys) or ours["graph_breaks"]:\n',
                "    if False:\n",
            ),
        ),
        ("tests/test_gpu_check.py::test_the_ratio_is_printed_only_when_both_sides_compiled_alike",),
    ),
    "43h": Plant(
        "one deadline: the time gpu_check leaves is passed on to the throughput (#43 item 3)",
        "a fixed 230 s for the throughput, as before, whatever gpu_check left",
        (
            (
                "    budget = left(EXPERTS + PROBE + WRAP_UP)  # what gpu_check left is passed on\n",
                "    budget = 230.0\n",
            ),
        ),
        ("tests/test_gpu_check.py::test_the_prepared_gpu_session_rehearses_end_to_end_on_cpu",),
    ),
    "43i": Plant(
        "the summary says what a one-GPU run leaves untested (#43 item 10)",
        "no such block: a world-1 pass reads as 'the GPU paths work'",
        (('    note(NOT_TESTED)\n    note(f"session: done', '    note(f"session: done'),),
        ("tests/test_gpu_check.py::test_the_prepared_gpu_session_rehearses_end_to_end_on_cpu",),
    ),
    "43j": Plant(
        "the probe asks gloo directly whether AVG averages (#43 item 8)",
        "the AVG attempt's op is dropped: gloo is asked to sum, and the probe reports 'sums'",
        (
            (
                "        dist.reduce_scatter_tensor(scattered, torch.arange(2.0, device=device) + rank, op=op)\n",
                "        dist.reduce_scatter_tensor(scattered, torch.arange(2.0, device=device) + rank)\n",
            ),
        ),
        ("tests/test_gpu_check.py::test_the_prepared_gpu_session_rehearses_end_to_end_on_cpu",),
    ),
    "43k": Plant(
        "async save: the staging is timed through the end of its device-to-host copies (#43 item 6)",
        "timed to fabric.save's return, as before: the copies are only issued, and the GB/s can exceed PCIe",
        (("    _sync(fabric.device)  # the copies on the staging stream included\n", ""),),
        (
            "tests/test_gpu_check.py::"
            "test_the_save_figures_time_the_staging_through_its_copies_and_the_step_after_a_save_without_a_sync",
        ),
    ),
    "43l": Plant(
        "async save: the step right after a save is taken without a sync, so it shows the overlap (#43 item 6)",
        "a sync between the save and the step, as before: the copies finish outside both timers",
        (
            (
                "    returned = time.perf_counter()\n",
                "    _sync(fabric.device)\n    returned = time.perf_counter()\n",
            ),
        ),
        (
            "tests/test_gpu_check.py::"
            "test_the_save_figures_time_the_staging_through_its_copies_and_the_step_after_a_save_without_a_sync",
        ),
    ),
    "45a": Plant(
        "weights kept gathered across the micro-batches of a step (#45)",
        "no_backward_sync reshards after backward anyway: every micro-batch gathers the model again",
        (
            (
                "            unit.set_reshard_after_backward(False, recurse=False)\n",
                "            unit.set_reshard_after_backward(True, recurse=False)\n",
            ),
        ),
        ("tests/test_gradients.py::test_kept_gathered_weights_are_gathered_once_per_step_and_train_as_one_process",),
    ),
    "45b": Plant(
        "weights kept gathered: not resharded after forward either (#45)",
        "keep_gathered_while_accumulating leaves reshard_after_forward as given: each backward gathers the layers",
        (
            (
                "    return False\n\n\n@dataclass(frozen=True)\nclass Levers:",
                "    return reshard_after_forward\n\n\n@dataclass(frozen=True)\nclass Levers:",
            ),
        ),
        ("tests/test_gradients.py::test_kept_gathered_weights_are_gathered_once_per_step_and_train_as_one_process",),
    ),
    "45c": Plant(
        "keep_gathered_while_accumulating with reshard_after_forward=True is refused (#45)",
        "the contradiction is accepted silently (reshard_after_forward=True is dropped)",
        (("    if reshard_after_forward not in (None, False):\n        raise", "    if False:\n        raise"),),
        ("tests/test_gradients.py::test_kept_gathered_weights_refuse_resharding_after_forward",),
    ),
    "45d": Plant(
        "kept gathered weights gather once per step (#45)",
        "the planner counts a kept-gathered step's gathers once per micro-batch, as if resharded",
        (
            (
                "    gathers = 1 if training.keep_gathered_while_accumulating else accumulation_steps\n",
                "    gathers = accumulation_steps\n",
            ),
        ),
        (
            "tests/planning/test_weighed_levers.py::test_kept_gathered_weights_gather_once_per_step",
            "tests/planning/test_weighed_levers.py::test_each_layout_weighs_the_levers",
        ),
    ),
    "45e": Plant(
        "kept gathered weights hold the whole model (#45)",
        "the planner's Training keeps reshard_after_forward as given with the weights kept gathered: 2 layers counted",
        (
            (
                '            object.__setattr__(self, "reshard_after_forward", False)\n',
                "            pass\n",
            ),
        ),
        ("tests/planning/test_weighed_levers.py::test_kept_gathered_weights_hold_the_whole_model",),
    ),
    "45f": Plant(
        "selective recompute is weighed without being asked (#45)",
        "the rows weigh no and full recompute only",
        (
            (
                '    return ["none", "selective", *([user] if isinstance(user, int) else []), "full"]\n',
                '    return ["none", *([user] if isinstance(user, int) else []), "full"]\n',
            ),
        ),
        (
            "tests/planning/test_weighed_levers.py::test_recompute_is_weighed_without_being_asked",
            "tests/planning/test_weighed_levers.py::test_the_70b_answer_is_not_communication_bound",
        ),
    ),
    "45g": Plant(
        "full recompute costs its forward (#45)",
        "full recompute is costed as selective: no extra compute",
        (
            (
                '    recomputed = 0.0 if training.checkpointing == "selective" else'
                " training.checkpointed_layers(dims.num_layers)\n",
                "    recomputed = 0.0\n",
            ),
        ),
        ("tests/planning/test_weighed_levers.py::test_recompute_is_weighed_without_being_asked",),
    ),
    "45h": Plant(
        "a step time always, on a stated interconnect (#45)",
        "no inter-node bandwidth is assumed when none is given",
        (
            (
                "        if self.inter_node_bandwidth is None:\n"
                '            object.__setattr__(self, "inter_node_bandwidth", TYPICAL_INTER_NODE_BANDWIDTH)\n',
                "",
            ),
        ),
        ("tests/planning/test_weighed_levers.py::test_a_step_time_always_on_a_stated_interconnect",),
    ),
    "45i": Plant(
        "the recommendation names the lever that won (#45)",
        "the lever sentence is left out of the recommended line",
        (
            (
                '    why += f". {lever_sentence(plan, row)}"\n',
                "",
            ),
        ),
        (
            "tests/planning/test_weighed_levers.py::test_the_70b_answer_is_not_communication_bound",
            "tests/planning/test_expert.py::test_the_output_says_why_the_winner_won",
        ),
    ),
    "45j": Plant(
        "the recommendation names the runner-up (#45)",
        "no runner-up is named",
        (
            (
                "    second = runner_up(plan, row)\n",
                "    second = None\n",
            ),
        ),
        (
            "tests/planning/test_weighed_levers.py::test_the_70b_answer_is_not_communication_bound",
            "tests/planning/test_expert.py::test_the_output_says_why_the_winner_won",
        ),
    ),
    "45k": Plant(
        "near-ties go to the least TP before the least recompute (#45)",
        "near-ties go to the least recompute first: the 8B recipe at 8192 tokens gets TP 2",
        (
            (
                "        return (*parallel, recompute, kept, *inter_node, layout.shard_size)\n",
                "        return (recompute, *parallel, kept, *inter_node, layout.shard_size)\n",
            ),
        ),
        ("tests/planning/test_expert.py::test_torchtitans_published_recipes",),
    ),
    "45l": Plant(
        "an assumed fabric's near-ties go to the fewest bytes between nodes (#45)",
        "without bandwidths the near-ties skip the bytes: the 8B gets half-node shard groups",
        (
            (
                "        inter_node = (row.traffic.inter_node_bytes,) if assumed else ()\n",
                "        inter_node = ()\n",
            ),
        ),
        (
            "tests/planning/test_weighed_levers.py::test_a_step_time_always_on_a_stated_interconnect",
            "tests/planning/test_expert.py::test_the_recommendation_is_the_experts",
        ),
    ),
    "45m": Plant(
        "the weights are kept gathered across micro-batches, not at one micro-batch per step (#45)",
        "the planner weighs keeping them gathered at one micro-batch per step too (reshard_after_forward=False)",
        (
            (
                "        if not (keep and weighed and size == sequences_per_rank)\n",
                "        if True\n",
            ),
        ),
        ("tests/planning/test_expert.py::test_the_recommendation_is_the_experts",),
    ),
    "45n": Plant(
        "fabric-hsdp plan weighs the levers unless told (#45)",
        "the CLI never weighs the levers",
        (
            (
                "    weigh = (args.activation_checkpointing is None, args.keep_gathered_while_accumulating is None)\n",
                "    weigh = (False, False)\n",
            ),
        ),
        ("tests/planning/test_weighed_levers.py::test_the_cli_weighs_unless_told",),
    ),
    "45o": Plant(
        "the recommendation says the strategy arguments that run it (#45)",
        "the run-it line leaves out keep_gathered_while_accumulating=True",
        (
            (
                '        arguments.append("keep_gathered_while_accumulating=True")\n',
                "        pass\n",
            ),
        ),
        ("tests/planning/test_weighed_levers.py::test_the_recommendation_says_the_strategy_arguments_that_run_it",),
    ),
    "46t1": Plant(
        "tied weights stay one parameter under tensor parallelism, judged by the TP parity test (#46 item 3)",
        "retie leaves the embedding and the output head two parameters after the plan split them: hf-tied's embedding"
        " gradient lacks the head's part (its step-1 gradient fails its own floor)",
        (
            (
                "                setattr(model.get_submodule(module_name), attribute, params[0])\n",
                "                pass\n",
            ),
        ),
        ("tests/tensor_parallel/test_training.py::test_training_with_tensor_parallelism_matches_single_process",),
    ),
    "46t2": Plant(
        "fused rows are regrouped by tensor-parallel rank, judged by the TP parity test (#46 item 3)",
        "litgpt's qkv rows are not regrouped: Shard(0) gives the first rank Q heads 0-3 and the second K and V (its"
        " step-1 gradient fails its own floor)",
        (("    order = fused.module_order()\n", "    order = torch.arange(fused.rows)\n"),),
        ("tests/tensor_parallel/test_training.py::test_training_with_tensor_parallelism_matches_single_process",),
    ),
    "46t3": Plant(
        "sequence parallelism's first-layer split all-gathers the gradient in backward (#46 item 3)",
        "SplitSequence takes the rank's part of the sequence by a local slice: the forward is the same, the backward"
        " leaves each rank the gradient of its own half (hf and hf-tied with the levers fail their own floor)",
        (
            (
                "            part = whole.redistribute(placements=[Shard(1)]).to_local()"
                ".clone(memory_format=torch.contiguous_format)\n",
                "            part = args[0].chunk(device_mesh.size(), dim=1)[device_mesh.get_local_rank()]\n"
                "            part = part.clone(memory_format=torch.contiguous_format)\n",
            ),
        ),
        ("tests/tensor_parallel/test_training.py::test_training_with_tensor_parallelism_matches_single_process",),
    ),
    "46t4": Plant(
        "a 1 % gradient error in sequence parallelism's norms, judged per model on step-1 gradients (#46 item 3)",
        "the gathered output of every norm in front of column-wise layers passes 1.01x its gradient back, its forward"
        " exact (each model with the levers fails its own floor)",
        (
            (
                "    return output.redistribute(placements=[Replicate()])\n",
                "    output = output.redistribute(placements=[Replicate()])\n"
                "    return output + 0.01 * (output - output.detach())\n",
            ),
        ),
        ("tests/tensor_parallel/test_training.py::test_training_with_tensor_parallelism_matches_single_process",),
    ),
    "46t5": Plant(
        "a 1 % gradient error in one model's TP path fails the TP test (#46 item 1: it passed the launch floor)",
        "litgpt's fused qkv, split over the tensor-parallel ranks, passes 1.01x its output gradient back, its forward"
        " exact (litgpt's step-1 gradient fails its own floor)",
        (
            (
                "            style = ColwiseParallel()  # the regrouped rows split like any column-wise layer\n",
                "            style = ColwiseParallel()  # the regrouped rows split like any column-wise layer\n"
                "            module.register_forward_hook(lambda m, a, out: out + 0.01 * (out - out.detach()))\n",
            ),
        ),
        ("tests/tensor_parallel/test_training.py::test_training_with_tensor_parallelism_matches_single_process",),
    ),
    "46t6": Plant(
        "a 1 % error in hf-tied's layer-1 q_proj gradient fails the TP test (#46 item 1: it passed the launch floor)",
        "hf-tied's layer-1 q_proj, split over the tensor-parallel ranks, computes with its weight's gradient 1.01x,"
        " the forward and the gradient of its input exact (hf-tied's step-1 gradient fails its own floor)",
        (
            (
                "        parallelize_module(model, mesh, {name: style}, src_data_rank=None)\n",
                "        parallelize_module(model, mesh, {name: style}, src_data_rank=None)\n"
                "        if tied and name == 'model.layers.1.self_attn.q_proj':\n"
                "            def scaled(m, args, out):\n"
                "                weight = m.weight + 0.01 * (m.weight - m.weight.detach())\n"
                "                return torch.nn.functional.linear(args[0], weight).to_local()\n"
                "            module.register_forward_hook(scaled)\n",
            ),
        ),
        ("tests/tensor_parallel/test_training.py::test_training_with_tensor_parallelism_matches_single_process",),
    ),
    "41a": Plant(
        "expert gradients averaged over all data-parallel ranks (#41)",
        "the experts' local weights pass their gradient back whole: each sums the tokens of the expert group's 2"
        " ranks and FSDP averages over (replicate, expert_shard) only, so expert gradients are 2x",
        (("        name: _ScaleGradient.apply(p.to_local(), 1 / size)\n", "        name: p.to_local()\n"),),
        ("tests/test_expert_parallel.py::test_three_steps_with_accumulation_and_recompute_match_one_process",),
    ),
    "41b": Plant(
        "a rank whose experts receive no row still reduces their gradients (#41)",
        "the empty output is not tied to the experts' weights: that rank's experts get no gradient and skip the"
        " reduce-scatter the other ranks run",
        (("        if rows.shape[0] == 0:\n", "        if False:\n"),),
        ("tests/test_expert_parallel.py::test_a_rank_whose_experts_get_no_token_takes_part_and_gets_zero_gradients",),
    ),
    "41c": Plant(
        "selective activation checkpointing keeps the token exchange (#41)",
        "the all-to-all is not in the saved ops: selective recompute runs the forward's exchanges again in backward",
        (('"all_gather_into_tensor", "all_to_all_single"):\n', '"all_gather_into_tensor"):\n'),),
        ("tests/test_expert_parallel.py::test_three_steps_with_accumulation_and_recompute_match_one_process",),
    ),
    "41d": Plant(
        "each received row computed by its own expert (#41)",
        "the received rows are labelled with their experts in the wrong order (the counts read expert-major)",
        (
            (
                "    expert_of_row = torch.repeat_interleave(local_ids, received_counts.reshape(-1))\n",
                "    expert_of_row = torch.repeat_interleave(local_ids, received_counts.t().reshape(-1))\n",
            ),
        ),
        ("tests/test_expert_parallel.py::test_three_steps_with_accumulation_and_recompute_match_one_process",),
    ),
    "41e": Plant(
        "the expert dim innermost: expert groups are consecutive ranks of one node (#41)",
        "the coordinates put the expert index first: rank f * N + e read as (e, f)",
        (
            (
                "            return (replica, *divmod(position, self.expert_parallel_size))\n",
                "            return (replica, *reversed(divmod(position, self.expert_parallel_size)))\n",
            ),
        ),
        ("tests/test_topology.py::test_expert_parallel_splits_the_shard_dim_with_the_expert_dim_innermost",),
    ),
    "41p1": Plant(
        "the planner's expert dim: the gathered experts are a layer's E/N (#41)",
        "a rank's fused experts are not divided by the expert-parallel size (all E experts over S/N ranks)",
        (
            (
                "        shape[0] //= expert_parallel_size\n        fsdp_size //= expert_parallel_size\n",
                "        fsdp_size //= expert_parallel_size\n",
            ),
        ),
        (
            "tests/planning/test_expert_parallel_plan.py::test_memory_divides_the_gathered_experts_and_adds_the_received_tokens",
        ),
    ),
    "41p2": Plant(
        "the planner's expert dim: four all-to-alls per MoE layer and micro-batch (#41)",
        "the token all-to-all counted once per MoE layer instead of 4 times (dispatch, combine, forward, backward)",
        (("EXCHANGES = 4\n", "EXCHANGES = 1\n"),),
        ("tests/planning/test_expert_parallel_plan.py::test_qwen3_30b_expert_bytes_with_ep8_are_a_ninth_of_fsdp_only",),
    ),
    "41p3": Plant(
        "the planner's expert dim: full recompute runs the forward all-to-alls again (#41)",
        "full activation checkpointing's recomputed all-to-alls not counted (4 instead of 6)",
        (
            (
                "    return EXCHANGES + 2 * training.checkpointed_layers(num_layers) / num_layers\n",
                "    return EXCHANGES\n",
            ),
        ),
        ("tests/planning/test_expert_parallel_plan.py::test_qwen3_30b_expert_bytes_with_ep8_are_a_ninth_of_fsdp_only",),
    ),
    "41p4": Plant(
        "the planner's expert dim: gloo's reduce-scatter of the experts is an all-reduce (#41)",
        "the experts' reduce-scatter counted as NCCL's on gloo too",
        (
            (
                "        * experts.per_step(gathers, accumulation_steps, reduce_scatter_factor),\n",
                "        * experts.per_step(gathers, accumulation_steps, 1.0),\n",
            ),
        ),
        ("tests/planning/test_expert_parallel_plan.py::test_gloo_reduce_scatters_the_experts_as_all_reduces",),
    ),
    "41p5": Plant(
        "the planner's expert dim: the experts' FSDP group is expert_shard, S/N ranks (#41)",
        "the experts' gathers ring over the whole shard group's size instead of the expert_shard group's",
        (
            (
                "        EXPERT_SHARD_DIM: _ring(layout.expert_shard_size)\n",
                "        EXPERT_SHARD_DIM: _ring(layout.shard_size)\n",
            ),
        ),
        ("tests/planning/test_expert_parallel_plan.py::test_mixtral_and_qwen3_235b_with_and_without_ep",),
    ),
    "41p6": Plant(
        "the planner's expert dim: a dense model never gets EP (#41)",
        "make_plan skips the model's expert-parallel check: a dense model asked for EP 2 gets EP 2 rows",
        (("        problem = problem or expert_parallel_problem(model, layout.expert_parallel_size)\n", ""),),
        ("tests/planning/test_expert_parallel_plan.py::test_a_dense_model_never_gets_ep",),
    ),
    "41p7": Plant(
        "the planner's expert dim: received tokens counted with a margin for uneven routing (#41)",
        "the received rows counted at the balanced average (no imbalance margin)",
        (("RECEIVED_TOKENS_HEADROOM = 2.0\n", "RECEIVED_TOKENS_HEADROOM = 1.0\n"),),
        (
            "tests/planning/test_expert_parallel_plan.py::test_memory_divides_the_gathered_experts_and_adds_the_received_tokens",
        ),
    ),
    "41p8": Plant(
        "the planner's expert dim: shard_size='auto' returns the chosen expert-parallel size (#41)",
        "auto_topology resolves the chosen shard_size without its expert_parallel_size",
        (
            (
                "    sizes = (tensor_parallel_size, chosen.expert_parallel_size, chosen.context_parallel_size)\n",
                "    sizes = (tensor_parallel_size, 1, chosen.context_parallel_size)\n",
            ),
        ),
        ("tests/planning/test_expert_parallel_plan.py::test_shard_size_auto_returns_the_chosen_expert_parallel_size",),
    ),
    "41p9": Plant(
        "the planner's expert dim: the all-to-alls sit on the critical path (#41)",
        "the token all-to-alls counted as overlapped with compute, like FSDP's gathers",
        (
            (
                "    critical_bytes = sum(intra_by_dim.get(dim, 0.0) for dim in (TENSOR_DIM, EXPERT_DIM, CONTEXT_DIM))"
                "\n",
                "    critical_bytes = sum(intra_by_dim.get(dim, 0.0) for dim in (TENSOR_DIM, CONTEXT_DIM))\n",
            ),
        ),
        ("tests/planning/test_expert_parallel_plan.py::test_the_plan_proposes_ep8_for_qwen3_30b_on_2x8",),
    ),
    "41p10": Plant(
        "the planner's expert dim: the run-it line names expert_parallel_size (#41)",
        "strategy_call leaves expert_parallel_size out",
        (
            (
                '        arguments.append(f"expert_parallel_size={layout.expert_parallel_size}")\n',
                "        pass\n",
            ),
        ),
        ("tests/planning/test_expert_parallel_plan.py::test_the_plan_proposes_ep8_for_qwen3_30b_on_2x8",),
    ),
    "41c1": Plant(
        "expert parallelism: a raw load fills each rank's box of experts from the DTensor's placements (#41)",
        "a rank's box of an expert-parallel tensor is taken in rank order within its copy (rank 1 of 1 x 4 with"
        " shard_size='world' reads expert 1, which rank 2 holds), in every load mode",
        (
            (
                "    sizes, offsets = compute_local_shape_and_global_offset(tensor.shape, tensor.device_mesh,"
                " tensor.placements)\n",
                "    sizes, offsets = compute_local_shape_and_global_offset(tensor.shape, tensor.device_mesh,"
                " tensor.placements)\n"
                "    if len(tensor.placements) == 3 and sizes[0] < tensor.shape[0]:\n"
                "        import torch.distributed as dist\n"
                "        offsets = ((dist.get_rank() % (tensor.shape[0] // sizes[0])) * sizes[0], *offsets[1:])\n",
            ),
        ),
        (
            "tests/checkpoint/test_expert_parallel_checkpoints.py::test_hub_directory_loads_raw_at_expert_parallel_2_each_rank_reading_its_own_experts[1x4-world]",
        ),
        expect="weights_differ",
    ),
    "41c2": Plant(
        "expert parallelism: split replica reads split the experts too (#41)",
        "split replica reads skip tensors on the 3-D expert-parallel mesh: every replica reads its experts whole"
        " (values exact, twice the bytes)",
        (
            (
                "        and REPLICATE_DIM in mesh.replicated_dims(tensor)\n",
                "        and REPLICATE_DIM in mesh.replicated_dims(tensor)\n        and tensor.device_mesh.ndim == 2\n",
            ),
        ),
        (
            "tests/checkpoint/test_expert_parallel_checkpoints.py::test_hub_directory_loads_raw_at_expert_parallel_2_each_rank_reading_its_own_experts[2x2-node-split-replica-reads]",
            "tests/checkpoint/test_expert_parallel_checkpoints.py::test_sharded_save_at_expert_parallel_1_resumes_at_2_with_split_replica_reads",
        ),
        expect="bytes_read",
    ),
    "41c3": Plant(
        "expert parallelism: a resume restores the experts' AdamW state (#41)",
        "a sharded load allocates no optimizer state for the experts, so their moments are not restored",
        (
            (
                "            entries = saved.get(next(iter(fqns)))\n",
                "            entries = None if '.experts.' in name else saved.get(next(iter(fqns)))\n",
            ),
        ),
        (
            "tests/checkpoint/test_expert_parallel_checkpoints.py::test_sharded_save_at_expert_parallel_2_resumes_at_another_size_model_and_adamw_exactly",
            "tests/checkpoint/test_expert_parallel_checkpoints.py::test_sharded_save_at_expert_parallel_1_resumes_at_2_with_split_replica_reads",
        ),
        expect="Missing optimizer state for parameter 'model.layers.0.mlp.experts.gate_up_proj'",
    ),
    "41c4": Plant(
        "expert parallelism: full exports gather the experts whole (#41)",
        "a full export gathers DTensors on the 3-D expert-parallel mesh only over FSDP, keeping the rank's experts",
        (
            (
                "    if isinstance(tensor, DTensor):\n        tensor = tensor.full_tensor()\n    if not request:\n",
                "    if isinstance(tensor, DTensor) and tensor.device_mesh.ndim == 3:\n"
                "        tensor = tensor.redistribute(placements=[Replicate(), Replicate(), tensor.placements[2]])\n"
                "        tensor = tensor.to_local()\n"
                "    elif isinstance(tensor, DTensor):\n        tensor = tensor.full_tensor()\n    if not request:\n",
            ),
            (
                "    from torch.distributed.tensor import DTensor\n\n    if request:\n        _broadcast_name(name)\n",
                "    from torch.distributed.tensor import DTensor, Replicate\n\n    if request:\n"
                "        _broadcast_name(name)\n",
            ),
        ),
        (
            "tests/checkpoint/test_expert_parallel_checkpoints.py::test_full_exports_of_an_expert_parallel_model_hold_the_experts_whole",
        ),
    ),
    "41b1": Plant(
        "expert parallelism's bytes per step are those of the formula (#41 measured)",
        "each layer's experts, an FSDP unit of their own, stay gathered from forward to backward: the backward"
        " all-gather is skipped and the experts' bytes fall to 3/4 of the formula's (2 b_p + 2 b_r)",
        (
            (
                '"mesh": experts.mesh, **by_rows})\n',
                '"mesh": experts.mesh, **by_rows, "reshard_after_forward": False})\n',
            ),
        ),
        ("tests/test_expert_bytes.py::test_counted_expert_and_all_to_all_bytes_match_the_formula",),
        expect="experts all-gather + reduce-scatter",
    ),
    "41b2": Plant(
        "the token all-to-all counted by the rows that leave the rank (#41 measured)",
        "the benchmark's counter charges the rows a rank addresses to itself too: the token all-to-all counts"
        " T k h b_a per exchange instead of (N-1)/N of it",
        (
            (
                "    return sum(rows for peer, rows in enumerate(input_splits) if peer != rank) * row_bytes\n",
                "    return sum(input_splits) * row_bytes\n",
            ),
        ),
        ("tests/test_expert_bytes.py::test_counted_expert_and_all_to_all_bytes_match_the_formula",),
        expect="token all-to-all",
    ),
    "41b3": Plant(
        "a dry run of an expert-parallel rank (#41 dry run)",
        "the fake world's evenly split all-to-all is torch's fake one: the counts exchange hands back uninitialised"
        " memory, and the row exchange's split sizes come from it",
        (
            (
                "            return tensor.clone()  # every peer sends this rank what this rank sends it"
                " (see the module docstring)\n",
                "            pass\n",
            ),
        ),
        ("tests/test_dryrun.py::test_an_expert_parallel_rank_of_2x8_runs_its_token_exchange_in_the_fake_world",),
    ),
    "41b4": Plant(
        "a dry run of an expert-parallel rank (#41 dry run)",
        "the dry run's training script reads --expert_parallel_size but does not pass it to the strategy: the rank"
        " dry-runs FSDP only, every expert sharded by FSDP",
        (("        expert_parallel_size=args.expert_parallel_size,\n", ""),),
        ("tests/test_dryrun.py::test_an_expert_parallel_rank_of_2x8_runs_its_token_exchange_in_the_fake_world",),
        expect="assert [] == [(32, 32, 32)",
    ),
    "41f": Plant(
        "experts split by rows where the expert shards outnumber a rank's experts (#41)",
        "FSDP shards the experts by expert (Shard(0)) even with one expert over 2 expert-shard ranks",
        (("    by_rows = mesh.size(-1) * expert_parallel_size > count\n", "    by_rows = False\n"),),
        ("tests/test_expert_parallel.py::test_experts_split_by_rows_where_expert_shards_outnumber_a_ranks_experts",),
    ),
    "41g": Plant(
        "sharded_modules naming the experts class under expert parallelism (#41)",
        "the experts, a unit over their own mesh already, are sharded again as a unit of sharded_modules",
        (
            (
                "        if not any(child is unit for unit in experts_units):",
                "        if True:",
            ),
        ),
        ("tests/test_expert_parallel.py::test_experts_split_by_rows_where_expert_shards_outnumber_a_ranks_experts",),
    ),
    "41i": Plant(
        "LoRA on the experts refused under expert parallelism (#41)",
        "the check for adapters on the experts is gone: peft's adapters on the fused experts would not be split",
        (
            (
                '    if any("lora_" in param_name for param_name, _ in experts.named_parameters()) or hasattr(',
                "    if False and (",
            ),
        ),
        ("tests/test_expert_parallel.py::test_lora_on_the_experts_is_refused_with_the_reason",),
    ),
    "41j": Plant(
        "experts modules of another forward refused under expert parallelism (#41)",
        "an experts module whose forward takes rows already dispatched is split like transformers' routed ones",
        (("    if not _routed_forward(experts):\n", "    if False:\n"),),
        ("tests/test_expert_parallel.py::test_refusals_name_the_layer_and_what_works",),
    ),
    "41m1": Plant(
        "compile=True with a transformers MoE model's router aux loss (output_router_logits=True)",
        "the routers are traced in the compiled blocks again: transformers' recording hook reads no collector under"
        " dynamo, router_logits come back empty and load_balancing_loss_func raises IndexError",
        (("            router.__class__ = eager_call_class(type(router))\n", "            pass\n"),),
        ("tests/test_moe_compile.py::test_compiled_blocks_train_with_the_router_aux_loss_as_one_eager_process",),
        expect="IndexError: tuple index out of range",
    ),
    "41g1": Plant(
        "the GPU session's experts line: the local half of expert parallelism on one device (#41)",
        "the EP8 side builds all of the layer's experts, not its eighth: it measures FSDP twice and calls it EP",
        (
            (
                '    return experts // EXPERT_PARALLEL_SIZE if variant == "ep8" else experts\n',
                "    return experts\n",
            ),
        ),
        ("tests/test_gpu_check.py::test_the_experts_local_half_holds_an_eighth_of_the_experts_on_the_same_rows",),
        expect="assert (16, 16) == (16, 2)",
    ),
    "42a": Plant(
        "context parallelism: queries see their own document only (#42)",
        "the gathered keys' mask is causal over the whole packed sequence: documents see each other",
        (
            (
                "    return (mask[None] & same_document).unsqueeze(1)\n",
                "    return mask[None].expand(len(documents), -1, -1).unsqueeze(1)\n",
            ),
        ),
        ("tests/test_context_parallel.py::test_packed_sequences_split_over_two_ranks_train_as_one_process",),
    ),
    "42b": Plant(
        "context parallelism: gradients averaged over the data-parallel ranks (#42)",
        "FSDP averages over all ranks of its mesh, each context group counted C times: gradients C times too small",
        (("    if mesh.context is not None:\n        divide_gradients", "    if False:\n        divide_gradients"),),
        ("tests/test_context_parallel.py::test_packed_sequences_split_over_two_ranks_train_as_one_process",),
    ),
    "42c": Plant(
        "context parallelism: the batch cut as attention reads it (#42)",
        "shard_sequence keeps contiguous chunks while attention places each rank's tokens head-tail",
        (
            (
                "    index = token_index(length // size, rank, size, tensors[0].device)\n",
                "    index = torch.arange(rank * length // size, (rank + 1) * length // size)\n",
            ),
        ),
        ("tests/test_context_parallel.py::test_packed_sequences_split_over_two_ranks_train_as_one_process",),
    ),
    "42d": Plant(
        "context parallelism: the loss over the whole sequences' labels (#42)",
        "each rank divides its tokens' loss by its own label count, not the context group's",
        (('        count = all_reduce(count, "sum", group)\n', "        count = count\n"),),
        ("tests/test_context_parallel.py::test_packed_sequences_split_over_two_ranks_train_as_one_process",),
    ),
    "42e": Plant(
        "context parallelism: a forward without position ids refused (#42)",
        "the model numbers each rank's chunk 0 .. T/C - 1 when the position ids are not passed",
        (('    if kwargs.get("position_ids") is None:\n', "    if False:\n"),),
        ("tests/test_context_parallel.py::test_misuse_is_refused_saying_what_to_do",),
    ),
    "42f": Plant(
        "context parallelism without documents: each chunk attends to the keys up to its own end (#42)",
        "each chunk's keys stop one short of its end (its last token sees neither itself nor the one before)",
        (("        end = start + chunk\n", "        end = start + chunk - 1\n"),),
        ("tests/test_context_parallel.py::test_packed_sequences_split_over_two_ranks_train_as_one_process",),
    ),
    "42p1": Plant(
        "the planner's context dim: activations of seq_len / C tokens (#42)",
        "a context-parallel rank's activations counted at the full sequence length (forgets the division by C)",
        (("    local = local_training(training, context_parallel_size)\n", "    local = training\n"),),
        (
            "tests/planning/test_context_parallel_plan.py::test_activations_are_those_of_seq_len_over_c_tokens_plus_the_gathered_keys_and_values",
        ),
    ),
    "42p2": Plant(
        "the planner's context dim: K and V both gathered (#42)",
        "only the keys counted in the gathered bytes (and their traffic), not the values",
        (
            (
                "    return 2 * training.workload.tokens * model.dims.kv_size * training.compute_bytes\n",
                "    return training.workload.tokens * model.dims.kv_size * training.compute_bytes\n",
            ),
        ),
        (
            "tests/planning/test_context_parallel_plan.py::test_llama31_8b_gathers_403_mb_of_keys_and_values_per_layer_forward_at_128k_over_4_ranks",
        ),
    ),
    "42p3": Plant(
        "the planner's context dim: the gradients' reduce-scatter counted (#42)",
        "the K/V traffic counts the forward all-gathers only, not the backward reduce-scatter of their gradients",
        (
            (
                "    return layers * (gathers_per_layer(training, layers) + reduce_scatter_factor) * per_collective\n",
                "    return layers * gathers_per_layer(training, layers) * per_collective\n",
            ),
        ),
        (
            "tests/planning/test_context_parallel_plan.py::test_llama31_8b_gathers_403_mb_of_keys_and_values_per_layer_forward_at_128k_over_4_ranks",
        ),
    ),
    "42p4": Plant(
        "the planner's context dim: weighed where nothing fits without it (#42)",
        "make_plan never weighs context parallelism by default: the 128k plan fits nowhere",
        (
            (
                "        weighed = _plan(*arguments, context_parallel_candidates(cluster.devices_per_node))\n",
                "        weighed = _plan(*arguments, [1])\n",
            ),
        ),
        (
            "tests/planning/test_context_parallel_plan.py::test_the_128k_plan_proposes_context_parallelism_where_nothing_fits_without_it",
        ),
    ),
    "42p5": Plant(
        "the planner's context dim: sequence length divisible by 2C (#42)",
        "layouts whose 2C does not divide the sequence length are planned instead of skipped",
        (("    if size == 1 or seq_len % (2 * size) == 0:\n", "    if True:\n"),),
        (
            "tests/planning/test_context_parallel_plan.py::test_a_sequence_length_not_divisible_by_2c_is_skipped_with_the_reason",
        ),
    ),
    "42p6": Plant(
        "the planner's context dim: shard_size='auto' returns the chosen context-parallel size (#42)",
        "auto_topology resolves the chosen layout without its context_parallel_size",
        (
            (
                "    sizes = (tensor_parallel_size, chosen.expert_parallel_size, chosen.context_parallel_size)\n",
                "    sizes = (tensor_parallel_size, chosen.expert_parallel_size, 1)\n",
            ),
        ),
        (
            "tests/planning/test_context_parallel_plan.py::test_auto_returns_context_parallelism_where_nothing_fits_without_it",
        ),
    ),
    "42p7": Plant(
        "the planner's context dim: a rank computes 1 / C of its group's micro-batch (#42)",
        "the compute per rank not divided by C: each rank of a context group costed as if it ran the whole sequence",
        (
            (
                "    sharing = layout.tensor_parallel_size * layout.context_parallel_size\n",
                "    sharing = layout.tensor_parallel_size\n",
            ),
        ),
        (
            "tests/planning/test_context_parallel_plan.py::test_the_128k_plan_proposes_context_parallelism_where_nothing_fits_without_it",
        ),
    ),
    "42p8": Plant(
        "the planner's context dim: a split attention keeps a second output copy, not its local K and V (#42)",
        "a context-parallel layer that keeps its activations counted as the unsplit estimate at s / C tokens",
        (("    split = split_attention_bytes(model, local, context_parallel_size)\n", "    split = 0\n"),),
        (
            "tests/planning/test_context_parallel_plan.py::test_activations_are_those_of_seq_len_over_c_tokens_plus_the_gathered_keys_and_values",
        ),
    ),
    "42m1": Plant(
        "the planner's activations within 15 % of the measured peak at CP 1 and 2 (#42)",
        "the output head's estimate without the loss's backward: the logits only, not the log-probabilities and their"
        " gradient",
        (
            (
                "    head = tokens * dims.vocab_size * (element + 8) / vocabulary\n",
                "    head = tokens * dims.vocab_size * element / vocabulary\n",
            ),
        ),
        (
            "tests/test_context_parallel.py::test_a_rank_peaks_at_most_0_6_of_the_activations_at_context_parallel_2_within_15_percent_of_the_planner",
        ),
        expect="pytest.approx(peak, rel=0.15)",
    ),
    "42m2": Plant(
        "a context-parallel rank's peak activations at most 0.6x of CP 1's (#42)",
        "each rank of a context group runs the whole sequences (shard_sequence cuts nothing)",
        (
            (
                "    return tuple(tensor[:, index] for tensor in (*tensors, position_ids))\n",
                "    return (*tensors, position_ids)\n",
            ),
        ),
        (
            "tests/test_context_parallel.py::test_a_rank_peaks_at_most_0_6_of_the_activations_at_context_parallel_2_within_15_percent_of_the_planner",
        ),
        expect="0.6 *",
    ),
    "42x1": Plant(
        "the fine-tune example under context parallelism reports the unsplit run's validation loss (#42)",
        "each rank counts the whole windows' tokens for its part's loss sum: the validation loss C times too small",
        (("    return total, labels.numel()\n", "    return total, windows[:, 1:].numel()\n"),),
        ("tests/test_examples.py::test_finetune_with_context_parallelism_reports_the_losses_of_the_unsplit_run",),
    ),
    "42x2": Plant(
        "the dry run's training step under context parallelism is a user's (#42)",
        "train_script.py cuts the sequences but does not pass the model their position ids",
        (("    logits = model(inputs, position_ids=position_ids).logits\n", "    logits = model(inputs).logits\n"),),
        ("tests/test_dryrun.py::test_a_context_parallel_rank_of_2x8_runs_its_split_sequences_in_the_fake_world",),
        expect="pass the model the position ids",
    ),
    "42x3": Plant(
        "the fine-tune example under context parallelism reports the unsplit run's training loss (#42)",
        "the logged train loss is the mean of the ranks' shares, not the sum of each context group's",
        (("            mean_loss *= parallel.context_parallel_size\n", ""),),
        ("tests/test_examples.py::test_finetune_with_context_parallelism_reports_the_losses_of_the_unsplit_run",),
    ),
    "42l1": Plant(
        "context parallelism for litgpt's GPT: RoPE at the rank's positions in the whole sequence (#42)",
        "each rank's RoPE rows are those of positions 0 .. T/C - 1, as litgpt's GPT numbers its local tokens",
        (
            (
                "        module.cos, module.sin = module.cos[positions], module.sin[positions]\n",
                "        module.cos, module.sin = module.cos[:tokens], module.sin[:tokens]\n",
            ),
        ),
        ("tests/test_context_parallel.py::test_packed_sequences_split_over_two_ranks_train_as_one_process[litgpt-2]",),
    ),
    "42r1": Plant(
        "a save under context parallelism resumes at another context_parallel_size exactly (#42)",
        "a sharded load restores AdamW's exp_avg_sq rounded through bf16",
        (
            (
                "            set_optimizer_state_dict(self.model, optimizer, tensors[key])\n",
                "            set_optimizer_state_dict(self.model, optimizer, tensors[key])\n"
                "            for entries in optimizer.state.values():\n"
                "                if 'exp_avg_sq' in entries:\n"
                "                    entries['exp_avg_sq'].copy_(entries['exp_avg_sq'].bfloat16().float())\n",
            ),
        ),
        ("tests/test_context_parallel.py::test_a_save_at_context_parallel_2_resumes_at_1_exactly",),
        expect="'moments': ['exp_avg_sq']",
    ),
    "42c5": Plant(
        "compiled blocks under context parallelism train as one process (#42)",
        "traced by dynamo, the gradient of the gathered keys reaches their ranks 1.5x too large (forward unchanged)",
        (
            (
                "    keys = all_gather_tensor_autograd(key.contiguous(), 2, group)\n",
                "    keys = all_gather_tensor_autograd(key.contiguous(), 2, group)\n"
                "    if torch.compiler.is_compiling():\n"
                "        keys = keys * 1.5 - keys.detach() * 0.5\n",
            ),
        ),
        ("tests/test_context_parallel.py::test_compiled_blocks_and_bf16_mixed_under_context_parallelism",),
        expect='facts["compiled"]',
    ),
    "42c6": Plant(
        "bf16-mixed under context parallelism trains as fp32 within bf16's rounding (#42)",
        "in bf16 the gradient of the gathered keys reaches their ranks 1.5x too large (forward unchanged)",
        (
            (
                "    keys = all_gather_tensor_autograd(key.contiguous(), 2, group)\n",
                "    keys = all_gather_tensor_autograd(key.contiguous(), 2, group)\n"
                "    if key.dtype == torch.bfloat16:\n"
                "        keys = keys * 1.5 - keys.detach() * 0.5\n",
            ),
        ),
        ("tests/test_context_parallel.py::test_compiled_blocks_and_bf16_mixed_under_context_parallelism",),
        expect='facts["bf16"]',
    ),
    "46j1": Plant(
        "bf16-mixed and 16-mixed judged against fp32 within the half dtype's rounding, not 0 < loss < 10 (#46)",
        "FSDP2 sums the data-parallel ranks' gradients without dividing them (torch 2.8's gloo took AVG as a sum):"
        " the dtypes, and the losses under AdamW, are as before",
        (
            (
                "unit.set_force_sum_reduction_for_comms(True)  # FSDP2 sums, then divides the shard itself\n",
                "unit.set_force_sum_reduction_for_comms(True)\n"
                "                unit.set_gradient_divide_factor(1.0)  # sums, divides by 1\n",
            ),
        ),
        (
            "tests/test_strategy.py::test_mixed_precision_computes_in_half_over_fp32_shards_and_reduces_in_fp32"
            "[bf16-mixed-torch.bfloat16]",
        ),
        expect='facts["ours"][what] <= tolerance[what]',
    ),
    "46j2": Plant(
        "LoRA training judged by the noise floor of one process, not a fixed 1e-5 on the adapters (#46)",
        "the sharded run's learning rate is 0.0011 % high: its adapters ~1.1e-5 off (relative), ~8e-6 absolute",
        (
            (
                "        logits_at_start = logits_of(model, inputs).detach().clone()\n"
                "    optimizer = fabric.setup_optimizers(torch.optim.AdamW(model.parameters(), lr=LEARNING_RATE))\n",
                "        logits_at_start = logits_of(model, inputs).detach().clone()\n"
                "    optimizer = fabric.setup_optimizers(\n"
                "        torch.optim.AdamW(model.parameters(), lr=LEARNING_RATE * 1.000011)\n"
                "    )\n",
            ),
        ),
        ("tests/test_lora.py::test_lora_base_loads_strict_and_trains_like_one_process",),
        expect="assert not {'parameters'",
    ),
    "46j3": Plant(
        "LoRA: 'it trained' is a fall of the loss, not first loss != last (#46)",
        "the learning rate is 1000x too small in the run and its reference alike: the loss moves, by ~0.001 %",
        (
            (
                "LEARNING_RATE = 1e-2\nSTEPS = 3\nGLOBAL_BATCH = 8\n",
                "LEARNING_RATE = 1e-5\nSTEPS = 3\nGLOBAL_BATCH = 8\n",
            ),
        ),
        ("tests/test_lora.py::test_lora_base_loads_strict_and_trains_like_one_process",),
        expect="assert fell > TRAINED_MARGIN",
    ),
    "46j4": Plant(
        "the GPU rehearsal's throughput judged against its logged steps and batch, not tokens_per_s > 0 (#46)",
        "the throughput counts the micro-batch's token rows with their extra target token (sequence + 1): 3 % high",
        (
            (
                "    tokens = args.micro_batch * config.max_seq_len\n    parameters = sum(",
                "    tokens = args.micro_batch * (config.max_seq_len + 1)\n    parameters = sum(",
            ),
        ),
        ("tests/test_gpu_check.py::test_the_prepared_gpu_session_rehearses_end_to_end_on_cpu",),
        expect="assert 0.0312",
    ),
    "46j5": Plant(
        "the dry run's step peak judged against a buffer the script holds inside the step, not the report's own"
        " arithmetic with a peak that may be 0 (#46)",
        "each phase's host peak is the resident set at the phase's end (VmRSS), not its high-water mark (VmHWM)",
        (
            (
                "            host_peak=max(0, host_peak() - self.baseline_host),\n",
                "            host_peak=max(0, host_resident() - self.baseline_host),\n",
            ),
        ),
        ("tests/test_dryrun.py::test_rank_5_of_2x4_loads_its_shard_stops_after_max_steps_and_saves_into_scratch",),
        expect="assert buffer <= report.step_peak",
    ),
    "46j6": Plant(
        "the planner's peak against the measured peak RSS within 5 % of the ratio measured, not +-25 % (#46)",
        "the planner's activations forget the loss's fp32 log-probabilities of the logits (8 bytes a logit)",
        (
            (
                "    head = tokens * dims.vocab_size * (element + 8) / vocabulary\n",
                "    head = tokens * dims.vocab_size * element / vocabulary\n",
            ),
        ),
        ("tests/planning/test_measured.py::test_predicted_shard_bytes_and_peak_memory_match_the_measured",),
        expect="assert all(0.93 <= ratio <= 1.03",
    ),
    "45n1": Plant(
        "--no_compute counts the step's allocations as the real step's allocator holds them (#45)",
        "the counter misses UntypedStorage.resize_, how FSDP2 allocates and frees its all-gathered parameters",
        (
            (
                "            return counter._resize(storage, size)\n",
                "            return counter._original_resize(storage, size)\n",
            ),
        ),
        ("tests/test_dryrun.py::test_no_compute_counts_what_the_real_step_allocates[selective]",),
        expect="counted_allocations",
    ),
    "45n2": Plant(
        "--no_compute counts the step's allocations as the real step's allocator holds them (#45)",
        "an op's output that shares an input's storage (in place, a view) is counted as a new allocation",
        (("            if declared.alias_info is not None:\n", "            if False:\n"),),
        (
            "tests/test_dryrun.py::test_the_counter_counts_new_storages_until_freed_not_views_in_place_writes_or_real_tensors",
        ),
        expect="assert counter.live == counter.peak == 4000",
    ),
    "45p1": Plant(
        "the planner's peak is the largest moment the counted 70B step found, not a sum at the start of backward (#45)",
        "the last block's backward counts every activation and the head's gathered weights and gradient at once",
        (
            (
                "        layer = kept + self.recompute + self.logits + self.gathered + self.received_tokens\n",
                "        layer = self.activations + self.head_backward + self.gathered + self.received_tokens\n",
            ),
        ),
        (
            "tests/planning/test_counted_peak.py::test_the_70b_answers_planned_peak_is_within_10_percent_of_its_counted_step",
        ),
        expect="assert 0.9 <= COUNTED_70B_PEAK / memory.total <= 1.0",
    ),
}
