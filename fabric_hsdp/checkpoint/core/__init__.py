"""The core every other checkpoint layer uses: file I/O, atomic commit, key matching, boxes, lazy tensors and DCP's
plumbing.

* :mod:`fileio`: positioned reads into tensors, ``O_DIRECT`` writes.
* :mod:`commit`: outputs appear at their path atomically, or not at all; :mod:`watchdog`: a rank stalled in
  checkpoint I/O fails every rank (``io_timeout``).
* :mod:`keys`: matching checkpoint keys to a model's (``key_map``, wrapper prefixes, tied names); :mod:`mismatch`:
  why a checkpoint does not fit (another project's names, another model or config, adapters only).
* :mod:`box`: one box (offsets and sizes) of a tensor; :mod:`boxes`: the boxes of a stored tensor a rank's local
  shard holds, presented to DCP as :class:`StoredBoxes`.
* :mod:`lazy_tensor` and :mod:`tree`: a tensor read only when asked, and walking nested state of them.
* :mod:`dcp_planners` and :mod:`dcp_errors`: DCP's planners with safe unpickling, and its errors unpacked.
* :mod:`progress`: progress bars and throughput lines.
* :mod:`lazy_expression`: a tensor made of stored tensors by torch operations (a converted checkpoint's), read one
  box at a time.

What the checkpoint code knows about model libraries (LoRA names, fused rows, tied names) is in
:mod:`fabric_hsdp.models`, below it.
"""

from fabric_hsdp.checkpoint.core.commit import atomic_output
from fabric_hsdp.checkpoint.core.keys import KeyMapSpec, KeyMatch, format_key_errors, make_key_map, match_keys
from fabric_hsdp.checkpoint.core.lazy_tensor import LazyTensor

__all__ = ["KeyMapSpec", "KeyMatch", "LazyTensor", "atomic_output", "format_key_errors", "make_key_map", "match_keys"]
