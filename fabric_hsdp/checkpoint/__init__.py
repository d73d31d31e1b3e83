"""Checkpoints: every format behind one small interface, read lazily, written atomically and streaming.

Data flows one way: a path becomes a source, a source fills shards, shards become a checkpoint. Four layers, each
importing only the ones below it:

* :mod:`~fabric_hsdp.checkpoint.training`: what ``fabric.save``/``load``/``load_raw`` run on every rank (sharded
  DCP saves and loads, background saves, split replica reads, full exports, raw loading into shards). Imports
  Lightning.
* :mod:`~fabric_hsdp.checkpoint.writers`: full files (torch, safetensors), DCP directories, offline conversion.
* :mod:`~fabric_hsdp.checkpoint.formats`: ``open_checkpoint`` and one reader per format behind ``CheckpointSource``.
* :mod:`~fabric_hsdp.checkpoint.core`: file I/O, atomic commit, key matching, boxes, lazy tensors, DCP's plumbing.

This module only re-exports the public names. Importing it imports torch but not Lightning (the ``fabric-hsdp``
command relies on that).
"""

from fabric_hsdp.checkpoint.core.commit import atomic_output
from fabric_hsdp.checkpoint.core.keys import KeyMatch, format_key_errors, make_key_map, match_keys
from fabric_hsdp.checkpoint.core.lazy_tensor import LazyTensor
from fabric_hsdp.checkpoint.formats.detect import open_checkpoint
from fabric_hsdp.checkpoint.formats.source import CheckpointSource, TensorInfo
from fabric_hsdp.checkpoint.writers.convert import ConvertSummary, convert_checkpoint, inspect_checkpoint
from fabric_hsdp.checkpoint.writers.dcp_writer import write_dcp
from fabric_hsdp.checkpoint.writers.full_files import write_safetensors, write_torch_file

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
