"""TPU chips' facts: the memory a program may use on one and the published peaks, by generation,
and the name JAX gives each (Device.device_kind). The deviceless compile check (aot/) compiles
for them; the runner reads a chip's ridge point (layers/pipeline.py's microbatches).
"""

from __future__ import annotations

from dataclasses import dataclass

GiB = 2**30


@dataclass(frozen=True)
class Chip:
    """One TPU generation as this check uses it: the memory a program may use and the published
    per-chip peaks a roofline divides by."""

    name: str  # as in the target names (v5e, v6e, v5p)
    pallas_version: str  # Pallas's ChipVersion for the chip (Mosaic's lowering asks for it)
    hbm_bytes: int  # what libtpu lets one program use (its out-of-memory limit), not the sticker
    bf16_flops: float  # per chip, per second
    int8_ops: float
    hbm_bandwidth: float  # bytes per second
    topologies: dict[int, str]  # chips -> the topology a target of that many chips compiles on


# The usable HBM is libtpu's own limit (read from its out-of-memory messages on this host); the
# peaks are Google's published per-chip figures (v5p's per chip, two TensorCores).
CHIPS = {
    "v5e": Chip("v5e", "v5e", int(15.75 * GiB), 197e12, 394e12, 819e9,
                {1: "v5e:2x2", 4: "v5e:2x2", 8: "v5e:2x4", 16: "v5e:4x4"}),
    "v6e": Chip("v6e", "v6e", int(31.25 * GiB), 918e12, 1836e12, 1640e9,
                {1: "v6e:2x2", 4: "v6e:2x2", 8: "v6e:2x4", 16: "v6e:4x4"}),
    "v5p": Chip("v5p", "v5p", int(95.74 * GiB), 459e12, 918e12, 2765e9,
                {4: "v5p:2x2x1", 8: "v5p:2x2x2"}),
}  # fmt: skip


# What JAX calls each chip (Device.device_kind), libtpu's deviceless devices included.
DEVICE_KINDS = {"TPU v5 lite": "v5e", "TPU v6 lite": "v6e", "TPU v5": "v5p", "TPU v5p": "v5p"}


def ridge_tokens(device_kind: str) -> int | None:
    """The rows a bf16 matmul takes to compute as long as the chip reads its weights in (2 flops
    per 2-byte weight and row: peak flops / HBM bandwidth); None for a chip not in CHIPS."""
    chip = CHIPS.get(DEVICE_KINDS.get(device_kind, ""))
    return None if chip is None else round(chip.bf16_flops / chip.hbm_bandwidth)
