"""Fabric's precision strings, one table: the dtype of the sharded state, of compute and gathers, and of the gradient
reduction. FSDP2's ``MixedPrecisionPolicy`` (:mod:`fabric_hsdp.setup.fsdp`) and the planner's bytes
(:mod:`fabric_hsdp.planning.memory`) both read it, so they cannot disagree.

Mixed precision keeps fp32 master shards and reduces gradients in fp32; "true" half precision built the parameters in
that dtype already, so FSDP2 needs no policy. Dtypes are named, not ``torch.dtype`` objects: the planner runs without
importing torch.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class PrecisionDtypes:
    """The dtypes one Fabric precision string trains with (names of ``torch`` dtypes).

    Attributes:
        state: The sharded parameters, gradients and optimizer state.
        compute: The gathered parameters that forward and backward compute with.
        reduce: The gradients' reduce-scatter and all-reduce.
    """

    state: str
    compute: str
    reduce: str

    @property
    def mixed(self) -> bool:
        """Whether compute runs in another dtype than the state (FSDP2 casts at each gather)."""
        return self.compute != self.state

    @property
    def state_bytes(self) -> int:
        return DTYPE_BYTES[self.state]

    @property
    def compute_bytes(self) -> int:
        return DTYPE_BYTES[self.compute]

    @property
    def reduce_bytes(self) -> int:
        return DTYPE_BYTES[self.reduce]


DTYPE_BYTES = {"float64": 8, "float32": 4, "bfloat16": 2, "float16": 2}

PRECISION_DTYPES: dict[str, PrecisionDtypes] = {
    "32-true": PrecisionDtypes("float32", "float32", "float32"),
    "bf16-mixed": PrecisionDtypes("float32", "bfloat16", "float32"),
    "16-mixed": PrecisionDtypes("float32", "float16", "float32"),
    "bf16-true": PrecisionDtypes("bfloat16", "bfloat16", "bfloat16"),
    "16-true": PrecisionDtypes("float16", "float16", "float16"),
    "64-true": PrecisionDtypes("float64", "float64", "float64"),
}

# Fabric's short spellings, as `Fabric(precision=...)` and the planner's `--precision` accept them
ALIASES = {"32": "32-true", "bf16": "bf16-mixed", "16": "16-mixed", "64": "64-true", "half": "16-true"}


def canonical_precision(precision: str) -> str | None:
    """Fabric's full precision string for ``precision`` (``"bf16"`` -> ``"bf16-mixed"``), ``None`` if unsupported."""
    name = ALIASES.get(str(precision), str(precision))
    return name if name in PRECISION_DTYPES else None
