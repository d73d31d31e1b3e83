"""Every format behind one interface: :func:`open_checkpoint` returns a lazy :class:`CheckpointSource`.

* :mod:`source`: the interface (``CheckpointSource``, ``TensorInfo``); :mod:`wrapped`: the raw-vs-wrapped rule.
* :mod:`detect`: :func:`open_checkpoint`, which tells the formats apart by content.
* One module per format: :mod:`torch_file`, :mod:`safetensors_file`, :mod:`hf_directory`, :mod:`dcp_directory`;
  DCP's ``.metadata`` in :mod:`dcp_metadata`, its tensors read with one copy in :mod:`dcp_reader`
  (a chunk's layout found by :mod:`torch_chunk` without ``torch.load``).
"""

from fabric_hsdp.checkpoint.formats.detect import open_checkpoint
from fabric_hsdp.checkpoint.formats.source import CheckpointSource, TensorInfo

__all__ = ["CheckpointSource", "TensorInfo", "open_checkpoint"]
