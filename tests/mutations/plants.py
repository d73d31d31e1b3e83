"""The planted bugs of issue #22, one per finding: what is changed, and the tests that must fail because of it.

Each edit is ``(old, new)``: ``old`` must occur exactly once in ``fabric_hsdp/``, ``tests/`` or ``examples/`` (found by
content, so a file that moves keeps its plant). ``run.py`` applies them in a scratch copy, never here.
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


PLANTS: dict[str, Plant] = {
    "1": Plant(
        "raw loads judged on every weight",
        "read_local skips every embedding shard whose rows start past 0 (ranks 1 and 3 keep their init)",
        (
            (
                "    for piece in stored_pieces(target, fused):\n"
                "        sizes = [piece.stop - piece.start, *local.shape[1:]]\n",
                "    for piece in stored_pieces(target, fused):\n"
                "        if 'embed' in name and piece.offsets[0] > 0:\n"
                "            continue\n"
                "        sizes = [piece.stop - piece.start, *local.shape[1:]]\n",
            ),
        ),
        (
            "tests/test_load_raw.py::test_every_format_and_mode_loads_exactly",
            "tests/test_load_raw.py::test_transformers_save_pretrained_directories",
        ),
    ),
    "2": Plant(
        "killed saves: where the kill landed, and a save that raises",
        "every save over an existing checkpoint raises (the old checkpoint stays: 'old XOR new' held before)",
        (
            (
                "    staged = Path(broadcast(commit.staging_path(path)))\n",
                "    staged = Path(broadcast(commit.staging_path(path)))\n"
                "    if path.exists():\n"
                "        raise OSError('planted: saving over a checkpoint fails')\n",
            ),
        ),
        ("tests/test_checkpoint.py::test_killed_saves_leave_old_or_new_checkpoint",),
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
                "(layer if dims.num_layers else 0)",
                "0",
            ),
        ),
        ("tests/planning/test_plan.py::test_worked_example_65b_error_lists_what_would_fit",),
    ),
}
