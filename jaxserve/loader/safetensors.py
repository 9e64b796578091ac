"""Hugging Face checkpoint directories: ``config.json`` and ``*.safetensors`` -> numpy arrays.

Where it sits: the first step of model loading, before anything touches a device. The model
registry reads the config dict to pick and size a model class; the weight loader consumes the
``(hf_name, array)`` stream, maps names onto the model's parameters and places (shards) each one.
Arrays come out in the checkpoint's own dtype and Hugging Face layout; casting and transposing
belong to the model side, which knows the target.

The format is read directly from its header rather than through ``safetensors.numpy``: numpy has
no bfloat16, so that reader refuses exactly the checkpoints most models ship. ``ml_dtypes`` (a jax
dependency) supplies bfloat16 and the float8 types, which jax accepts as they are.
"""

from __future__ import annotations

import json
import math
import os
import struct
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import ml_dtypes
import numpy as np
from tqdm import tqdm

CONFIG_FILE = "config.json"
SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"

# Little-endian, as the format prescribes; byte order must not follow the host.
_DTYPES: dict[str, np.dtype] = {
    "BOOL": np.dtype(np.bool_),
    "U8": np.dtype("u1"),
    "I8": np.dtype("i1"),
    "U16": np.dtype("<u2"),
    "I16": np.dtype("<i2"),
    "U32": np.dtype("<u4"),
    "I32": np.dtype("<i4"),
    "U64": np.dtype("<u8"),
    "I64": np.dtype("<i8"),
    "F16": np.dtype("<f2"),
    "F32": np.dtype("<f4"),
    "F64": np.dtype("<f8"),
    "BF16": np.dtype(ml_dtypes.bfloat16),
    "F8_E4M3": np.dtype(ml_dtypes.float8_e4m3fn),
    "F8_E5M2": np.dtype(ml_dtypes.float8_e5m2),
}

# A header larger than this is not a header but a misread length: refuse before allocating it.
_MAX_HEADER_BYTES = 100 * 1024 * 1024


@dataclass(frozen=True)
class _TensorEntry:
    """Where one tensor's bytes sit, so files can be checked whole before anything is yielded."""

    name: str
    dtype: np.dtype
    shape: tuple[int, ...]
    start: int  # absolute byte offset in the file
    nbytes: int


def read_hf_config(model_dir: str) -> dict:
    """The model's ``config.json`` as a dict.

    Raises ValueError (naming the file) rather than OSError/JSONDecodeError so a bad path becomes
    one clear user-facing line instead of a traceback from deep inside start-up.
    """
    path = os.path.join(model_dir, CONFIG_FILE)
    try:
        with open(path, encoding="utf-8") as f:
            config = json.load(f)
    except FileNotFoundError as err:
        raise ValueError(f"{path}: no such file; a Hugging Face model directory needs a config.json") from err
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise ValueError(f"{path}: not a readable JSON config ({err})") from err
    if not isinstance(config, dict):
        raise ValueError(f"{path}: expected a JSON object, got {type(config).__name__}")
    return config


def iter_safetensors(
    model_dir: str, use_tqdm: bool = True, select: Callable[[str], bool] | None = None
) -> Iterator[tuple[str, np.ndarray]]:
    """Every tensor of the checkpoint as ``(hf_name, array)``, one at a time (only the names
    `select` accepts, when given).

    All headers are read and checked before the first tensor is yielded, so a missing shard or a
    truncated file fails at once, not after minutes of loading the shards before it. One tensor is
    held at a time: peak host memory is the largest tensor, not the checkpoint.
    """
    files = _checkpoint_files(model_dir)
    plan = [(path, _read_header(path)) for path in files]
    _check_index_coverage(model_dir, plan)
    if select is not None:
        plan = [(path, [e for e in entries if select(e.name)]) for path, entries in plan]
    total = sum(len(entries) for _, entries in plan)
    return _iter_planned(plan, total, use_tqdm)


def iter_safetensors_file(path: str) -> Iterator[tuple[str, np.ndarray]]:
    """Every tensor of one .safetensors file, checked whole first (see iter_safetensors)."""
    entries = _read_header(path)
    return _iter_planned([(path, entries)], len(entries), False)


def read_headers(model_dir: str) -> dict[str, tuple[np.dtype, tuple[int, ...]]]:
    """Every tensor's dtype and shape, from the headers alone."""
    return {e.name: (e.dtype, e.shape) for path in _checkpoint_files(model_dir) for e in _read_header(path)}


def _iter_planned(
    plan: list[tuple[str, list[_TensorEntry]]], total: int, use_tqdm: bool
) -> Iterator[tuple[str, np.ndarray]]:
    with tqdm(total=total, desc="Loading safetensors", unit="tensor", disable=not use_tqdm) as bar:
        for path, entries in plan:
            bar.set_postfix_str(os.path.basename(path), refresh=False)
            with open(path, "rb") as f:
                for entry in entries:
                    yield entry.name, _read_tensor(f, path, entry)
                    bar.update(1)


def _checkpoint_files(model_dir: str) -> list[str]:
    """The safetensors files of a directory, from its index when it is sharded."""
    index_path = os.path.join(model_dir, INDEX_FILE)
    single_path = os.path.join(model_dir, SINGLE_FILE)
    if os.path.isfile(index_path):
        weight_map = _read_weight_map(index_path)
        files = [os.path.join(model_dir, name) for name in sorted(set(weight_map.values()))]
        for path in files:
            if not os.path.isfile(path):
                raise ValueError(f"{path}: shard listed in {index_path} is missing")
        return files
    if os.path.isfile(single_path):
        return [single_path]
    if not os.path.isdir(model_dir):
        raise ValueError(f"{model_dir}: no such model directory")
    raise ValueError(f"{model_dir}: no weights found (expected {SINGLE_FILE} or {INDEX_FILE})")


def _read_weight_map(index_path: str) -> dict[str, str]:
    try:
        with open(index_path, encoding="utf-8") as f:
            index = json.load(f)
        weight_map = index["weight_map"]
    except (OSError, UnicodeDecodeError, json.JSONDecodeError, KeyError, TypeError) as err:
        raise ValueError(f"{index_path}: not a valid safetensors index ({err!r})") from err
    if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
        raise ValueError(f"{index_path}: weight_map must map tensor names to file names")
    return weight_map


def _check_index_coverage(model_dir: str, plan: list[tuple[str, list[_TensorEntry]]]) -> None:
    """An index that names a tensor its shard lacks means a stale or mixed-up download."""
    index_path = os.path.join(model_dir, INDEX_FILE)
    if not os.path.isfile(index_path):
        return
    present = {(os.path.basename(path), entry.name) for path, entries in plan for entry in entries}
    for name, file_name in _read_weight_map(index_path).items():
        if (file_name, name) not in present:
            shard = os.path.join(model_dir, file_name)
            raise ValueError(f"{shard}: tensor {name!r} listed in {index_path} is missing from this shard")


def _read_header(path: str) -> list[_TensorEntry]:
    """Parse and validate one file's header: every tensor must lie inside the file."""
    try:
        file_size = os.path.getsize(path)
        with open(path, "rb") as f:
            prefix = f.read(8)
            if len(prefix) < 8:
                raise ValueError("file shorter than the 8-byte header length")
            (header_len,) = struct.unpack("<Q", prefix)
            if header_len > min(_MAX_HEADER_BYTES, file_size - 8):
                raise ValueError(f"header length {header_len} does not fit in a {file_size}-byte file")
            header = json.loads(f.read(header_len))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError, ValueError) as err:
        raise ValueError(f"{path}: not a valid safetensors file ({err})") from err
    if not isinstance(header, dict):
        raise ValueError(f"{path}: not a valid safetensors file (header is not a JSON object)")

    data_start = 8 + header_len
    data_size = file_size - data_start
    entries = []
    for name, info in header.items():
        if name == "__metadata__":
            continue
        try:
            dtype = _DTYPES[info["dtype"]]
            shape = tuple(int(d) for d in info["shape"])
            begin, end = (int(o) for o in info["data_offsets"])
        except (KeyError, TypeError, ValueError) as err:
            raise ValueError(f"{path}: tensor {name!r} has an unreadable header entry {info!r}") from err
        nbytes = math.prod(shape) * dtype.itemsize
        if end - begin != nbytes or begin < 0:
            raise ValueError(f"{path}: tensor {name!r} offsets {begin}..{end} do not match {shape} {dtype}")
        if end > data_size:
            raise ValueError(
                f"{path}: truncated; tensor {name!r} ends at byte {data_start + end} of {file_size}"
            )
        entries.append(_TensorEntry(name, dtype, shape, data_start + begin, nbytes))
    # File order makes the reads sequential, which is what a disk (or page cache) likes.
    entries.sort(key=lambda e: e.start)
    return entries


def _read_tensor(f, path: str, entry: _TensorEntry) -> np.ndarray:
    # A bytearray, not bytes: the array must be writable and own its memory, since callers may
    # cast or transpose it in place and the file is closed afterwards.
    buf = bytearray(entry.nbytes)
    f.seek(entry.start)
    if f.readinto(buf) != entry.nbytes:
        raise ValueError(f"{path}: truncated while reading tensor {entry.name!r}")
    return np.frombuffer(buf, dtype=entry.dtype).reshape(entry.shape)
