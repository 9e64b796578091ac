"""TPU targets this process can compile for without a TPU: slices of the chips in jaxserve/chips.py
and their devices.

libtpu (the `tpu` extra) compiles for a TPU topology it is only described: `jax.experimental.
topologies.get_topology_desc` gives devices to build a mesh on, and programs lowered over that mesh
compile with libtpu's real compiler on this host. Topology names must divide libtpu's default
host bounds, so a target of fewer chips (v5e-1, say) takes the first chips of a 2x2 topology.
"""

from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass

from jaxserve.chips import CHIPS, Chip


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
