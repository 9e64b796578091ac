"""Prompt embeddings (vLLM's `--enable-prompt-embeds`): a prompt given as the rows the model's
embedding table would give for its tokens, [sequence_length, hidden_size], fed to the layers in
place of the table's rows.

Offline, `{"prompt_embeds": array}` takes anything numpy reads (a torch tensor included, read
through its own methods: jaxserve never imports torch). Over HTTP, vLLM's wire format is a
base64-encoded `torch.save` file of one tensor; `decode_tensor` reads that format without torch:
a zip archive whose `data.pkl` rebuilds the tensor from a storage kept as raw bytes beside it. The
pickle is read by an unpickler that knows four callables (the tensor rebuild, the float storage
classes, OrderedDict) and nothing else, so a payload can name no other code; sparse tensors (a
rebuild it does not know) are refused, as are dtypes other than float32, float16 and bfloat16.
"""

from __future__ import annotations

import base64
import binascii
import io
import pickle
import zipfile
from collections import OrderedDict

import ml_dtypes
import numpy as np

# torch's storage classes as pickled by torch.save -> numpy dtype
_STORAGES = {
    "FloatStorage": np.dtype(np.float32),
    "HalfStorage": np.dtype(np.float16),
    "BFloat16Storage": np.dtype(ml_dtypes.bfloat16),
}
# the largest decoded payload: 1 GiB of tensor
MAX_BYTES = 1 << 30


class _Storage:
    def __init__(self, name: str):
        self.dtype = _STORAGES[name]


def _rebuild_tensor(storage, offset, size, stride, *_):
    if not isinstance(storage, np.ndarray):
        raise ValueError("not a tensor of a known storage")
    size, stride = tuple(int(s) for s in size), tuple(int(s) for s in stride)
    if any(s < 0 for s in size + stride) or int(offset) < 0:
        raise ValueError("negative sizes or strides")
    if (
        size
        and np.prod(size)
        and int(offset) + sum((n - 1) * s for n, s in zip(size, stride)) >= storage.size
    ):
        raise ValueError("the tensor reads past its storage")
    item = storage.dtype.itemsize
    view = np.lib.stride_tricks.as_strided(
        storage[int(offset) :], shape=size, strides=[s * item for s in stride], writeable=False
    )
    return np.array(view)


class _Unpickler(pickle.Unpickler):
    def __init__(self, data: bytes, archive: zipfile.ZipFile, prefix: str):
        super().__init__(io.BytesIO(data))
        self.archive, self.prefix = archive, prefix

    def find_class(self, module: str, name: str):
        if module == "torch._utils" and name == "_rebuild_tensor_v2":
            return _rebuild_tensor
        if module == "torch" and name in _STORAGES:
            return _Storage(name)
        if module == "collections" and name == "OrderedDict":
            return OrderedDict
        raise pickle.UnpicklingError(f"{module}.{name} is not allowed in a tensor")

    def persistent_load(self, pid):
        if not (isinstance(pid, tuple) and len(pid) == 5 and pid[0] == "storage"):
            raise pickle.UnpicklingError("unknown persistent id")
        storage, key = pid[1], str(pid[2])
        if not isinstance(storage, _Storage):
            raise pickle.UnpicklingError("unknown storage type")
        raw = self.archive.read(f"{self.prefix}data/{key}")
        return np.frombuffer(raw, storage.dtype)


def decode_tensor(data: str | bytes) -> np.ndarray:
    """The tensor of a base64-encoded torch.save file; ValueError naming what is wrong."""
    try:
        raw = base64.b64decode(data, validate=True)
    except (binascii.Error, ValueError, TypeError) as e:
        raise ValueError(f"prompt_embeds is not valid base64: {e}") from None
    if len(raw) > MAX_BYTES:
        raise ValueError(f"prompt_embeds is larger than {MAX_BYTES} bytes.")
    try:
        with zipfile.ZipFile(io.BytesIO(raw)) as archive:
            pkl = [n for n in archive.namelist() if n.endswith("data.pkl")]
            if len(pkl) != 1:
                raise ValueError("no data.pkl")
            prefix = pkl[0][: -len("data.pkl")]
            if sum(i.file_size for i in archive.infolist()) > MAX_BYTES:
                raise ValueError(f"larger than {MAX_BYTES} bytes")
            tensor = _Unpickler(archive.read(pkl[0]), archive, prefix).load()
    except (zipfile.BadZipFile, pickle.UnpicklingError, ValueError, KeyError, EOFError, TypeError) as e:
        raise ValueError(
            f"prompt_embeds must be a base64-encoded torch.save file of one dense float32, float16 or "
            f"bfloat16 tensor ({e})."
        ) from None
    if not isinstance(tensor, np.ndarray):
        raise ValueError("prompt_embeds must hold one tensor.")
    return tensor


def embedding_width(hf_config) -> int:
    """The width of the embedding table's rows, which prompt embeddings have: the hidden size
    (OPT's word_embed_proj_dim where it projects them in; GPT-2's n_embd)."""
    hf = hf_config
    return int(hf.get("word_embed_proj_dim") or hf.get("hidden_size") or hf["n_embd"])


def as_prompt_embeds(value, hidden_size: int) -> np.ndarray:
    """float32 [sequence_length, hidden_size] from an array-like (a [1, L, H] batch of one is
    taken as its row, as vLLM does); ValueError on any other shape or dtype."""
    if type(value).__module__.startswith("torch"):  # a torch tensor: read by its own methods
        value = value.detach().to("cpu").float().numpy()
    array = np.asarray(value)
    if array.dtype not in (np.float32, np.float16, np.float64, np.dtype(ml_dtypes.bfloat16)):
        raise ValueError(f"prompt_embeds must hold floats, got {array.dtype}.")
    if array.ndim == 3 and array.shape[0] == 1:
        array = array[0]
    if array.ndim != 2:
        raise ValueError(
            f"prompt_embeds must be [sequence_length, hidden_size], got shape {list(array.shape)}."
        )
    if array.shape[1] != hidden_size:
        raise ValueError(
            f"prompt_embeds rows must have the model's hidden size {hidden_size}, got {array.shape[1]}."
        )
    if array.shape[0] == 0:
        raise ValueError("The prompt is empty.")
    array = array.astype(np.float32)
    if not np.isfinite(array).all():
        raise ValueError("prompt_embeds holds a value that is not finite.")
    return array
