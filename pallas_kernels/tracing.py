"""The platform a step is being traced for.

Code inside a step that picks an implementation by platform (a CPU-only native call, a CPU-only
way to write fp8 pages) must ask the mesh the step is traced under, not the host's default
backend: the TPU compile check traces TPU programs on a CPU host."""

from __future__ import annotations

import jax


def traced_platform() -> str:
    """ "cpu", "tpu", "gpu"...: the devices of the mesh being traced under, else the default backend."""
    mesh = jax.sharding.get_abstract_mesh()
    device = None if mesh.empty else mesh.abstract_device
    return device.platform if device is not None else jax.default_backend()
