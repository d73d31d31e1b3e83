"""Read a DCP checkpoint's model tensors with torch's own tool (an independent reader of what we write)."""

import tempfile
from pathlib import Path

import torch
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save


def read_model_tensors(path: Path, model_key: str = "model") -> dict[str, torch.Tensor]:
    with tempfile.TemporaryDirectory() as tmp:
        dcp_to_torch_save(path, Path(tmp) / "out.pt")
        return torch.load(Path(tmp) / "out.pt", weights_only=True)[model_key]
