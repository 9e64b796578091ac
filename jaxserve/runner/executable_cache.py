"""Compiled steps kept on disk, loaded at start-up without tracing or lowering.

Where it sits: ModelRunner._compile asks here before it traces a step. JAX's persistent
compilation cache saves the XLA compile, but it is keyed by the lowered program, so every start
still traces and lowers each bucket (most of a second per bucket for a 30-layer model on a CPU,
seconds for a large model on a TPU). Here the key is everything the traced program is a function
of, known before tracing: the source of jaxserve and its kernels, the JAX/Flax versions, the model
class and its arguments, the step variant and the arguments' shapes, dtypes and shardings, the
devices, and the XLA flags. A hit deserializes the executable (about a fifth of a bucket's cost).

The entries are pickles of executables this user's own processes wrote: the same trust as JAX's
cache directory beside it. An entry that does not load is recompiled and overwritten.

Only on a single-process CPU mesh for now, where it replaces JAX's cache: XLA:CPU cannot
serialize again an executable it read from JAX's cache (the copy fails at run time, "Function ...
not found"), so what is stored here must be compiled without it; and the CPU is the one backend
where storing was checked end to end.
"""

from __future__ import annotations

import functools
import hashlib
import importlib.util
import logging
import os
import pickle
import tempfile
from importlib import metadata

import jax
from jax.experimental import serialize_executable

from jaxserve.config import jaxserve_cache_dir

logger = logging.getLogger(__name__)

_PACKAGES = ("jaxserve", "pallas_kernels")
# Host-side packages: they never build a device program, so editing them keeps the stored steps.
_HOST_ONLY = {"engine", "entrypoints", "benchmarks", "loader"}


@functools.cache
def source_digest() -> str:
    """A digest of the Python files a step can be traced through: a code change is a new key."""
    digest = hashlib.sha256()
    for package in _PACKAGES:
        (root,) = importlib.util.find_spec(package).submodule_search_locations
        for folder, dirs, files in sorted(os.walk(root)):
            dirs[:] = sorted(d for d in dirs if not (folder == root and d in _HOST_ONLY))
            for name in sorted(files):
                if name.endswith(".py"):
                    path = os.path.join(folder, name)
                    digest.update(os.path.relpath(path, root).encode())
                    with open(path, "rb") as fh:
                        digest.update(fh.read())
    return digest.hexdigest()


def _environment() -> tuple:
    versions = tuple(metadata.version(p) for p in ("jax", "jaxlib", "flax"))
    flags = tuple(os.environ.get(v, "") for v in ("XLA_FLAGS", "LIBTPU_INIT_ARGS"))
    options = (jax.config.jax_enable_x64, str(jax.config.jax_default_matmul_precision))
    return (source_digest(), versions, flags, options)


class ExecutableCache:
    """Serialized `jax.stages.Compiled` objects under `directory`, one file per key."""

    def __init__(self, directory: str):
        self.directory = directory

    def _path(self, key: tuple) -> str:
        material = repr((_environment(), key)).encode()
        return os.path.join(self.directory, hashlib.sha256(material).hexdigest() + ".pkl")

    def load(self, key: tuple, devices) -> jax.stages.Compiled | None:
        """The executable stored under `key`, loaded onto `devices` (the mesh's, in order)."""
        path = self._path(key)
        try:
            with open(path, "rb") as fh:
                payload, in_tree, out_tree = pickle.load(fh)
            return serialize_executable.deserialize_and_load(
                payload, in_tree, out_tree, execution_devices=devices
            )
        except FileNotFoundError:
            return None
        except Exception as err:  # written by another version of a dependency, or damaged
            logger.debug("Ignoring the stored step %s: %s", path, err)
            return None

    def store(self, key: tuple, compiled: jax.stages.Compiled) -> None:
        unloaded = getattr(compiled._executable, "_unloaded_executable", None)
        if unloaded is None or unloaded.host_callbacks or unloaded.ordered_effects:
            return  # host callbacks (interpreted kernels) name objects of this process only
        try:
            blob = pickle.dumps(serialize_executable.serialize(compiled))
        except Exception as err:  # a backend whose executables do not serialize
            logger.debug("Cannot store a compiled step: %s", err)
            return
        try:
            os.makedirs(self.directory, exist_ok=True)
            with tempfile.NamedTemporaryFile(dir=self.directory, suffix=".tmp", delete=False) as fh:
                fh.write(blob)
            os.replace(fh.name, self._path(key))  # readers see a whole entry or none
        except OSError as err:  # a read-only or full cache only costs time
            logger.warning("Could not store a compiled step in %s: %s", self.directory, err)


def enable_compilation_cache(cache_dir: str | None, mesh: jax.sharding.Mesh) -> ExecutableCache | None:
    """What makes a second start-up fast. On a single-process CPU mesh, the runner's own store
    of whole executables (runner/executable_cache.py: neither compiled nor traced again) instead
    of JAX's persistent cache, whose entries XLA:CPU cannot serialize again; elsewhere JAX's
    persistent compilation cache (compiled again from disk, traced and lowered every start)."""
    if cache_dir == "":
        return None
    cache_dir = cache_dir or jaxserve_cache_dir("xla")
    single_cpu = jax.process_count() == 1 and mesh.devices.flat[0].platform == "cpu"
    if single_cpu and jax.config.jax_compilation_cache_dir is None:
        return ExecutableCache(os.path.join(cache_dir, "jaxserve-steps"))
    jax.config.update("jax_compilation_cache_dir", cache_dir)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
    return None
