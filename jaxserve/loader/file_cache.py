"""What was derived from a slow-to-read checkpoint file, kept on disk for the next start-up.

Where it sits: the loader layer. A GGUF file costs seconds at every start (its header parsed,
every tensor dequantized and stacked) to give the same result each time, so the first start
keeps that result under ``$XDG_CACHE_HOME/jaxserve/files/<file version>/`` and later ones read
it back: the model config as JSON, the host weights as one ``.npy`` per parameter (read back
memory-mapped). An entry is keyed by the file's version (absolute path, size, modification
time, inode) and by the source of the code that derives it (the loader and the model ports), so
a rewritten file or a changed translation gets a new entry. Anything unreadable in the cache is
rebuilt, never trusted; a cache that cannot be written only costs time.
"""

from __future__ import annotations

import functools
import glob
import hashlib
import json
import logging
import os
import shutil
import tempfile

import numpy as np

from jaxserve.config import jaxserve_cache_dir

logger = logging.getLogger(__name__)


def entry_dir(path: str, what: str) -> str:
    """The cache directory for ``what`` derived from this version of the file at ``path``."""
    path = os.path.abspath(path)
    stat = os.stat(path)
    identity = f"{path}\0{stat.st_size}\0{stat.st_mtime_ns}\0{stat.st_ino}\0{_code_digest()}"
    digest = hashlib.sha256(identity.encode()).hexdigest()[:24]
    return jaxserve_cache_dir("files", f"{os.path.basename(path)}-{digest}", what)


@functools.cache
def _code_digest() -> str:
    """sha256 of the code that turns a file into configs and weights (a few ms, once)."""
    package = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    digest = hashlib.sha256()
    for source in sorted(
        glob.glob(os.path.join(package, "loader", "*.py"))
        + glob.glob(os.path.join(package, "models", "*.py"))
    ):
        with open(source, "rb") as f:
            digest.update(f.read())
    return digest.hexdigest()


def read_json(path: str, what: str) -> dict | None:
    try:
        with open(os.path.join(entry_dir(path, what), "value.json")) as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


def write_json(path: str, what: str, value: dict) -> None:
    _publish(entry_dir(path, what), lambda tmp: _dump_json(os.path.join(tmp, "value.json"), value))


def read_arrays(path: str, what: str, names: set[str]) -> dict[str, np.ndarray] | None:
    """The arrays kept for ``names`` (memory-mapped, read-only), or None unless all are there."""
    where = entry_dir(path, what)
    try:
        return {name: np.load(os.path.join(where, name + ".npy"), mmap_mode="r") for name in names}
    except (OSError, ValueError):
        return None


def write_arrays(path: str, what: str, arrays: dict[str, np.ndarray]) -> None:
    def write(tmp: str) -> None:
        for name, array in arrays.items():
            np.save(os.path.join(tmp, name + ".npy"), array)

    _publish(entry_dir(path, what), write)


def _dump_json(file: str, value: dict) -> None:
    with open(file, "w") as f:
        json.dump(value, f)


def _publish(where: str, write) -> None:
    """Write into a fresh directory beside ``where`` and rename it into place: a reader sees a
    whole entry or none, and two processes filling the same entry do not mix their files."""
    try:
        os.makedirs(os.path.dirname(where), exist_ok=True)
        tmp = tempfile.mkdtemp(dir=os.path.dirname(where), prefix=".tmp-")
        try:
            write(tmp)
            if os.path.isdir(where):  # an entry that could not be read back: replace it
                shutil.rmtree(where, ignore_errors=True)
            os.replace(tmp, where)
        except OSError:
            if os.path.isdir(where):  # another process published at the same moment: keep theirs
                return
            raise
        finally:
            if os.path.isdir(tmp):
                shutil.rmtree(tmp, ignore_errors=True)
    except OSError as err:
        logger.warning("Could not cache %s: %s", where, err)
