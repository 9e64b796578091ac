"""The adapters a server serves by name (--lora-modules, /v1/load_lora_adapter), each a
LoRARequest a request selects by naming it as its `model`."""

from __future__ import annotations

import itertools
import json
import threading

from jaxserve.lora.request import LoRARequest


def parse_lora_modules(specs: list[str] | None) -> list[tuple[str, str, str | None]]:
    """--lora-modules values, `name=path` or vLLM's JSON `{"name", "path", "base_model_name"}`,
    as (name, path, base model name); ValueError (one line) for any other."""
    modules = []
    for spec in specs or ():
        if spec.lstrip().startswith("{"):
            try:
                data = json.loads(spec)
                modules.append((str(data["name"]), str(data["path"]), data.get("base_model_name")))
            except (ValueError, KeyError, TypeError):
                raise ValueError(f'--lora-modules {spec!r}: a JSON module needs "name" and "path".') from None
            continue
        name, sep, path = spec.partition("=")
        if not sep or not name or not path:
            raise ValueError(f"--lora-modules {spec!r}: expected name=path or a JSON object.")
        modules.append((name, path, None))
    return modules


# lora_int_ids, never reused in a process: a name loaded again after an unload (or served by
# another server over the same engine) gets fresh prefix-cache pages and a fresh host copy
_IDS = itertools.count(1)


class LoRAModules:
    """Adapters by name, each with its own lora_int_id."""

    def __init__(self) -> None:
        self._by_name: dict[str, LoRARequest] = {}
        self._lock = threading.Lock()

    def add(self, name: str, path: str, base_model_name: str | None = None) -> LoRARequest:
        with self._lock:
            if name in self._by_name:
                raise ValueError(f"The lora adapter '{name}' has already been loaded.")
            request = LoRARequest(name, next(_IDS), path, base_model_name)
            self._by_name[name] = request
            return request

    def remove(self, name: str) -> LoRARequest:
        """KeyError for a name not served."""
        with self._lock:
            return self._by_name.pop(name)

    def get(self, name: str | None) -> LoRARequest | None:
        return self._by_name.get(name) if name is not None else None

    def all(self) -> list[LoRARequest]:
        return list(self._by_name.values())
