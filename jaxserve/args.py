"""Engine arguments with vLLM's names and defaults -> the frozen EngineConfig.

`EngineArgs` is what `LLM(**kwargs)` and the command line fill in: the flag table of
args_fields.py with the checks and the configuration of args_to_config.py. `validate` refuses, before anything is loaded, a value jaxserve cannot honour yet with a
ValueError that names the flag and what is supported, and warns about vLLM knobs that mean
nothing on JAX. `create_engine_config` then resolves what depends on the model (its config,
dtype, length) once.
"""

from __future__ import annotations

from dataclasses import dataclass

from jaxserve.args_fields import EngineArgsFields
from jaxserve.args_to_config import build_engine_config, validate
from jaxserve.config import EngineConfig


@dataclass
class EngineArgs(EngineArgsFields):
    def validate(self) -> None:
        """Refuse what needs neither a model nor a device, so a bad command line fails before
        anything starts (it touches no JAX device: a multi-process run must join its peers first).
        Called again by `create_engine_config`; the tier-C warnings are logged once per EngineArgs."""
        validate(self)

    def create_engine_config(self) -> EngineConfig:
        """Validate, join the other processes if asked (before any device is touched: JAX requires
        it), check the devices, then resolve the model once."""
        return build_engine_config(self)
