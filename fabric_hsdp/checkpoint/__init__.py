"""Checkpoints: every format behind one small interface, read lazily, written atomically and streaming.

Data flows one way: a path becomes a source, a source fills shards, shards become a checkpoint.

* The interface: :mod:`~fabric_hsdp.checkpoint.source` (``CheckpointSource``, ``LazyTensor``, ``TensorInfo``) and
  :func:`open_checkpoint` in :mod:`~fabric_hsdp.checkpoint.formats`, which detects the format and returns a reader:
  :mod:`torch_file`, :mod:`safetensors_file`, :mod:`hf_directory`, :mod:`dcp_directory`.
* Filling a sharded model from a source (``fabric.load_raw``): :mod:`~fabric_hsdp.checkpoint.loading`, with key
  matching in :mod:`~fabric_hsdp.checkpoint.keys`.
* The training path's own checkpoints: :mod:`sharded` (DCP, every rank in parallel), :mod:`background` (async
  saves), :mod:`replica_split` (reading each shard once under HSDP), :mod:`full` (one consolidated file from rank 0).
* Writing files: :mod:`writers` (torch file, safetensors), :mod:`dcp_writer` (DCP), all through :mod:`commit`
  (outputs appear atomically) and :mod:`fileio` (positioned reads, ``O_DIRECT`` writes).
* Offline tools: :mod:`~fabric_hsdp.checkpoint.convert` (``convert_checkpoint``, ``inspect_checkpoint``).
* DCP details shared by readers and the training path: :mod:`dcp_io`.

Importing this package imports torch but not Lightning (the ``fabric-hsdp`` command relies on that).
"""

from fabric_hsdp.checkpoint.commit import atomic_output
from fabric_hsdp.checkpoint.convert import ConvertSummary, convert_checkpoint, inspect_checkpoint
from fabric_hsdp.checkpoint.dcp_writer import write_dcp
from fabric_hsdp.checkpoint.formats import open_checkpoint
from fabric_hsdp.checkpoint.keys import KeyMatch, format_key_errors, make_key_map, match_keys
from fabric_hsdp.checkpoint.source import CheckpointSource, LazyTensor, TensorInfo
from fabric_hsdp.checkpoint.writers import write_safetensors, write_torch_file

__all__ = [
    "CheckpointSource",
    "ConvertSummary",
    "KeyMatch",
    "LazyTensor",
    "TensorInfo",
    "atomic_output",
    "convert_checkpoint",
    "format_key_errors",
    "inspect_checkpoint",
    "make_key_map",
    "match_keys",
    "open_checkpoint",
    "write_dcp",
    "write_safetensors",
    "write_torch_file",
]
