"""The training path: what ``fabric.save``/``fabric.load``/``fabric.load_raw`` run, on every rank.

* :mod:`checkpointer`: :class:`Checkpointer`, what the strategy's save and load hooks call: it picks the way down.
* :mod:`state`: :class:`CheckpointState`, a checkpoint state sorted by kind, and the tensors a checkpoint stores.
* :mod:`sharded`: DCP checkpoints written and read by every rank in parallel (a fresh optimizer's state allocated
  from the checkpoint by :mod:`optimizer_state`); :mod:`background`: the one save in flight (``async_save=True``),
  staged by :mod:`staging`; :mod:`replica_split`: reading each shard once under HSDP.
* :mod:`full`: one consolidated file saved from rank 0, gathering one tensor at a time; loaded as the model's
  tensors (:mod:`raw_load`), then its optimizers and plain values.
* :mod:`raw_load`: filling a sharded model from any format (``load_raw``).

This layer imports Lightning; the layers below it do not.
"""

from fabric_hsdp.checkpoint.training.background import BackgroundSaves
from fabric_hsdp.checkpoint.training.checkpointer import Checkpointer
from fabric_hsdp.checkpoint.training.full import restore_extras, save_full
from fabric_hsdp.checkpoint.training.raw_load import LoadMode, LoadResult, load_into_model
from fabric_hsdp.checkpoint.training.sharded import find_sharded, load_sharded, save_sharded
from fabric_hsdp.checkpoint.training.state import CheckpointState

__all__ = [
    "BackgroundSaves",
    "CheckpointState",
    "Checkpointer",
    "LoadMode",
    "LoadResult",
    "find_sharded",
    "load_into_model",
    "load_sharded",
    "restore_extras",
    "save_full",
    "save_sharded",
]
