"""Checkpoint formats behind one small interface: open a source of named tensors, match keys, write atomically."""

from fabric_hsdp.checkpoint.convert import ConvertSummary, convert_checkpoint, inspect_checkpoint
from fabric_hsdp.checkpoint.keys import KeyMatch, format_key_errors, make_key_map, match_keys
from fabric_hsdp.checkpoint.sources import CheckpointSource, LazyTensor, TensorInfo, open_checkpoint
from fabric_hsdp.checkpoint.writers import atomic_output, write_dcp, write_safetensors, write_torch_file

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
