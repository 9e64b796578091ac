"""TPU targets this process can compile for without a TPU: the chips' facts and their devices.

libtpu (the `tpu` extra) compiles for a TPU topology it is only described: `jax.experimental.
topologies.get_topology_desc` gives devices to build a mesh on, and programs lowered over that mesh
compile with libtpu's real compiler on this host. Topology names must divide libtpu's default
host bounds, so a target of fewer chips (v5e-1, say) takes the first chips of a 2x2 topology.
"""

from __future__ import annotations

import contextlib
import os
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


@dataclass(frozen=True)
class Target:
    """A TPU slice by its Cloud name: v5e-4 is four v5e chips; v5p-8 is four v5p chips (v5p slices
    are named by TensorCores, two per chip)."""

    name: str
    chip: Chip
    num_chips: int

    @classmethod
    def parse(cls, name: str) -> Target:
        generation, _, count = name.partition("-")
        chip = CHIPS.get(generation)
        if chip is None or not count.isdigit():
            raise ValueError(f"unknown TPU target {name!r}; one of {', '.join(target_names())}")
        chips = int(count) // 2 if generation == "v5p" else int(count)
        if chips not in chip.topologies:
            raise ValueError(f"unknown TPU target {name!r}; one of {', '.join(target_names())}")
        return cls(name, chip, chips)

    def devices(self) -> list:
        """The slice's devices, as libtpu describes them (compile only: nothing runs on them)."""
        os.environ.setdefault("TPU_ACCELERATOR_TYPE", "v5litepod-4")  # quiets libtpu's host probing
        os.environ.setdefault("TPU_WORKER_HOSTNAMES", "localhost")
        os.environ.setdefault("TPU_SKIP_MDS_QUERY", "1")
        # several compile checks may run side by side: none of them owns a chip
        os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
        try:
            from jax.experimental import topologies

            topology = topologies.get_topology_desc(
                topology_name=self.chip.topologies[self.num_chips], platform="tpu"
            )
        except Exception as err:  # no libtpu: jax's own error says little
            raise ValueError(
                f"cannot describe a {self.name} without libtpu ({err}); install it with "
                "`pip install -e '.[tpu]'`"
            ) from None
        return list(topology.devices)[: self.num_chips]


def target_names() -> list[str]:
    names = []
    for chip in CHIPS.values():
        per_name = 2 if chip.name == "v5p" else 1
        names += [f"{chip.name}-{n * per_name}" for n in chip.topologies]
    return names


@contextlib.contextmanager
def pallas_target(chip: Chip):
    """Pallas kernels lowered inside ask this chip's facts: Mosaic's lowering asks the *default*
    device for them, which is this host's CPU."""
    from jax._src.pallas.mosaic import tpu_info

    version = tpu_info.ChipVersion(chip.pallas_version)
    previous = tpu_info.registry.get("cpu")
    tpu_info.registry["cpu"] = lambda: tpu_info.get_tpu_info_for_chip(version, 1)
    try:
        yield
    finally:
        if previous is None:
            tpu_info.registry.pop("cpu", None)
        else:
            tpu_info.registry["cpu"] = previous
