"""Writing checkpoints, streaming one tensor at a time and atomically: :mod:`full_files` (torch file, safetensors),
:mod:`dcp_writer` (a DCP directory from one process), :mod:`convert` (offline conversion and inspection); every
DCP file goes through :mod:`direct_writer` (``O_DIRECT``, no CRC32 in sharded saves, fsync'ed when closed)."""

from fabric_hsdp.checkpoint.writers.convert import ConvertSummary, convert_checkpoint, inspect_checkpoint
from fabric_hsdp.checkpoint.writers.dcp_writer import write_dcp
from fabric_hsdp.checkpoint.writers.full_files import write_safetensors, write_torch_file

__all__ = [
    "ConvertSummary",
    "convert_checkpoint",
    "inspect_checkpoint",
    "write_dcp",
    "write_safetensors",
    "write_torch_file",
]
