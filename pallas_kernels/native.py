"""Native CPU kernels: C++ handlers called from the jitted step through XLA's FFI.

On a CPU, Pallas only interprets, and XLA:CPU runs a few of the decode step's parts far below what
the memory allows (a quantized projection is dequantized into a float32 copy of its kernel every
step, then read back by a dot). The kernels for those parts are C++ files beside their pure-jnp
references (`<kernel>/cpu.cc`), compiled together on the machine that runs them, for its own
instruction set (`-march=native`), on first use: about 4 s, once, kept in ~/.cache/jaxserve/kernels
under a name that hashes the sources, the compiler, jaxlib's FFI headers and the CPU. Each handler is
registered with XLA under its name (HANDLERS); native.h holds what the handlers share.

Where no C++ compiler is found or the build fails, `load()` says so once in the log and returns
False; the step then runs the references, which compute the same values (the kernels are tested
against them), only slower.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
import threading

import jax

from pallas_kernels.tracing import traced_platform

logger = logging.getLogger(__name__)

_HERE = os.path.dirname(os.path.abspath(__file__))
SOURCES = ("quantized_matmul/cpu.cc", "ragged_paged_attention/cpu.cc")  # relative to this package
# XLA custom-call target -> the C symbol of its handler
HANDLERS = {
    "jaxserve_q4_matmul": "JaxserveQ4Matmul",
    "jaxserve_q8_head": "JaxserveQ8Head",
    "jaxserve_ragged_paged_attention": "JaxserveRaggedPagedAttention",
    "jaxserve_write_rows": "JaxserveWriteRows",
}
FLAGS = ("-O3", "-march=native", "-fopenmp-simd", "-std=c++17", "-shared", "-fPIC", "-w")

_lock = threading.Lock()
_state: dict[str, object] = {}  # "loaded": bool once tried, "library": the CDLL, "error": why not


def _cache_dir() -> str:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "jaxserve", "kernels")


def _compiler() -> str | None:
    return os.environ.get("CXX") or shutil.which("c++") or shutil.which("g++") or shutil.which("clang++")


def _cpu_identity() -> str:
    """What -march=native compiles for: the CPU's model and feature flags."""
    try:
        with open("/proc/cpuinfo") as fh:
            lines = [ln for ln in fh if ln.startswith(("model name", "flags"))]
        return "".join(sorted(set(lines)))
    except OSError:
        return platform.processor() + platform.machine()


def library_path(compiler: str) -> str:
    """Where the library for these sources, this compiler, jaxlib and this CPU is kept."""
    digest = hashlib.sha256()
    for rel in (*SOURCES, "native.h"):
        with open(os.path.join(_HERE, rel), "rb") as fh:
            digest.update(fh.read())
    version = subprocess.run([compiler, "--version"], capture_output=True, text=True, timeout=30).stdout
    for part in (version, jax.ffi.include_dir(), jax.lib.__version__, _cpu_identity(), " ".join(FLAGS)):
        digest.update(part.encode())
    return os.path.join(_cache_dir(), f"jaxserve-cpu-{digest.hexdigest()[:16]}.so")


def _build(compiler: str, path: str, flags: tuple[str, ...] = FLAGS) -> None:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=os.path.dirname(path))
    os.close(fd)
    try:
        sources = [os.path.join(_HERE, s) for s in SOURCES]
        cmd = [compiler, *flags, f"-I{jax.ffi.include_dir()}", f"-I{_HERE}", *sources, "-o", tmp]
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
        if done.returncode:
            raise RuntimeError(f"{' '.join(cmd)} failed:\n{done.stderr[-2000:]}")
        os.replace(tmp, path)  # atomic: another process building the same library sees it whole
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)


def load() -> bool:
    """Build (once per machine) and register the kernels; whether they can be used. Thread-safe;
    only the first call does any work."""
    with _lock:
        if "loaded" in _state:
            return bool(_state["loaded"])
        try:
            compiler = _compiler()
            if compiler is None:
                raise RuntimeError("no C++ compiler found (set CXX, or install g++)")
            path = library_path(compiler)
            if not os.path.exists(path):
                logger.info("Building the native CPU kernels (once per machine) into %s", path)
                _build(compiler, path)
            library = ctypes.CDLL(path)
            for target, symbol in HANDLERS.items():
                handler = jax.ffi.pycapsule(getattr(library, symbol))
                jax.ffi.register_ffi_target(target, handler, platform="cpu")
            _state.update(loaded=True, library=library)
        except Exception as err:  # the references compute the same values, only slower
            logger.warning("Native CPU kernels unavailable, running their jnp references: %s", err)
            _state.update(loaded=False, error=str(err))
        return bool(_state["loaded"])


def loaded() -> bool:
    """Whether load() succeeded (without trying to load)."""
    return bool(_state.get("loaded"))


def usable_in_trace() -> bool:
    """Whether the step being traced can call the kernels: on a CPU, with them loaded, for one device
    (a step sharded over several would have XLA gather every operand of the call to each device),
    or for each device on its own: in a shard_map manual over every axis of size > 1 (a pipeline
    stage's layers without tensor parallelism)."""
    if traced_platform() != "cpu" or not loaded():
        return False
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty:
        return True
    manual = set(mesh.manual_axes)
    return all(size == 1 or name in manual for name, size in mesh.shape.items())
