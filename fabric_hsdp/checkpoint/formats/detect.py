"""The formats this package reads, and :func:`open_checkpoint`, which tells them apart by content.

``open_checkpoint(path)`` detects the format from the content (not the file name) and returns a
:class:`CheckpointSource`: ``keys()``, ``tensor_info(name)`` (no data read), ``read(name)``, ``read_slice(name,
index)``, ``extras()`` and ``close()``. Accepted:

* ``"torch"``: a torch zip file (``torch.save``, any name) or a legacy non-zip pickle holding a raw state dict, e.g.
  litgpt's ``lit_model.pth``.
* ``"fabric"``: a torch file holding a Fabric/Lightning full checkpoint, ``{"model": {...}, "optimizer": ...,
  "step": 3}`` or PyTorch Lightning's ``{"state_dict": {...}, ...}``.
* ``"safetensors"``: one ``.safetensors`` file.
* ``"hf-safetensors"`` / ``"hf-bin"``: a Hugging Face directory with ``model.safetensors.index.json``,
  ``model.safetensors``, ``pytorch_model.bin.index.json`` or ``pytorch_model.bin``.
* ``"dcp"``: a ``torch.distributed.checkpoint`` directory (has ``.metadata``): Lightning's layout (``model.<name>``
  and ``optimizer.*`` keys, plain values in ``meta.pt``) or torch's flat ``torch_save_to_dcp`` output.

Raw or wrapped is decided from the content, the same way for torch files and DCP directories (for DCP on the
nesting recorded in its metadata):

* a dict whose values are all tensors is a **raw** state dict: every entry is a model tensor;
* a dict with no tensor at the top level whose ``"model"`` (else ``"state_dict"``) value is a dict of tensors is
  **wrapped**: that dict holds the model tensors (keys without the ``model.`` prefix), everything else is
  ``extras()`` (optimizer state, step, ...);
* anything else is an error that names the file and what it holds.

Tensors are always read to CPU, whatever device they were saved from. Torch and safetensors files are read with
positioned reads at offsets taken from their headers, into a fresh tensor or one given with ``out=``, so a
conversion holds about one tensor in memory (an mmap would keep every page it touched resident). ``read_slice``
reads only the requested box there; for DCP it reads only the stored chunks the box overlaps. ``weights_only=True`` (the
default) unpickles with torch's safe loader; ``weights_only=False`` is an explicit opt-in for trusted files and
logs a warning.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

from fabric_hsdp.checkpoint.formats.dcp_directory import DCPSource
from fabric_hsdp.checkpoint.formats.hf_directory import IndexedDirectory
from fabric_hsdp.checkpoint.formats.safetensors_file import SafetensorsFile, looks_like_safetensors
from fabric_hsdp.checkpoint.formats.source import ACCEPTED_FORMATS, CheckpointSource
from fabric_hsdp.checkpoint.formats.torch_file import TorchFileSource
from fabric_hsdp.errors import CheckpointError

_logger = logging.getLogger(__name__)


def _open_file(path: Path, weights_only: bool, format: str | None = None) -> CheckpointSource:
    with open(path, "rb") as file:
        head = file.read(16)
    size = path.stat().st_size
    if size == 0:
        raise CheckpointError(f"'{path}' is empty (0 bytes), not a checkpoint")
    if head.startswith(b"PK\x03\x04"):
        return TorchFileSource(path, weights_only=weights_only, format=format)
    if looks_like_safetensors(head):
        return SafetensorsFile(path, format=format or "safetensors")
    if head[:1] == b"\x80":  # pickle protocol opcode: torch's legacy (pre-1.6) format
        return TorchFileSource(path, weights_only=weights_only, format=format, legacy=True)
    raise CheckpointError(f"'{path}' is not a checkpoint (unrecognised content). Accepted: {ACCEPTED_FORMATS}")


def _open_directory(path: Path, weights_only: bool) -> CheckpointSource:
    if (path / ".metadata").is_file():
        return DCPSource(path, weights_only=weights_only)
    if (path / "model.safetensors.index.json").is_file():
        return IndexedDirectory(
            path, "hf-safetensors", path / "model.safetensors.index.json", lambda f: SafetensorsFile(f)
        )
    if (path / "model.safetensors").is_file():
        source = _open_file(path / "model.safetensors", weights_only, format="hf-safetensors")
        source.path = path
        return source
    if (path / "pytorch_model.bin.index.json").is_file():
        return IndexedDirectory(
            path, "hf-bin", path / "pytorch_model.bin.index.json", lambda f: _open_file(f, weights_only, "hf-bin")
        )
    if (path / "pytorch_model.bin").is_file():
        source = _open_file(path / "pytorch_model.bin", weights_only, format="hf-bin")
        source.path = path
        return source
    entries = sorted(entry.name for entry in path.iterdir())
    found = ", ".join(entries[:6]) + (f" and {len(entries) - 6} more" if len(entries) > 6 else "") or "nothing"
    raise CheckpointError(f"directory '{path}' is not a checkpoint (it holds {found}). Accepted: {ACCEPTED_FORMATS}")


def open_checkpoint(path: str | os.PathLike, *, weights_only: bool = True) -> CheckpointSource:
    """Open a checkpoint file or directory as a lazy source of named tensors; usable as a context manager.

    Args:
        path: a torch file, a ``.safetensors`` file, a Hugging Face directory or a DCP directory (see module doc).
        weights_only: unpickle with torch's safe loader. ``False`` runs arbitrary code from the file: only for
            checkpoints you trust.

    Raises:
        FileNotFoundError: ``path`` does not exist.
        CheckpointError: ``path`` is not a checkpoint, is truncated or damaged, or holds an unsupported layout.

    Example::

        with open_checkpoint("lit_model.pth") as source:
            for name in source.keys():
                tensor = source.read(name)
    """
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"checkpoint '{path}' does not exist")
    if not weights_only:
        _logger.warning(
            "Opening '%s' with weights_only=False: unpickling can run arbitrary code. Only do this for checkpoints"
            " you trust.",
            path,
        )
    if path.is_dir():
        return _open_directory(path, weights_only)
    return _open_file(path, weights_only)
