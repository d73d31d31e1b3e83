"""The setup pipeline: what ``setup_module`` runs (:mod:`pipeline`), one sibling module per step.

float8 (:mod:`float8`) -> tensor parallelism (``fabric_hsdp.tensor_parallel``) -> expert parallelism
(``fabric_hsdp.expert_parallel``) -> context parallelism (``fabric_hsdp.context_parallel``) -> activation
checkpointing (:mod:`activation_checkpointing`) -> compile (:mod:`compile`) -> ``fully_shard`` (:mod:`fsdp`, with
:mod:`precision`), then the local shards made real (:mod:`materialize`); :mod:`gradients`: their
synchronisation while accumulating and clipping over the mesh.
"""
