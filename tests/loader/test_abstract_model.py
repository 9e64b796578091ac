"""abstract_model: the shapes, dtypes and shardings load_model gives, with no weight read (what
the step programs are compiled from)."""

from __future__ import annotations

import jax
import pytest
from tiny_models import engine_kwargs

from jaxserve.args import EngineArgs
from jaxserve.loader.model_loader import abstract_model, load_model
from jaxserve.sharding import make_mesh


@pytest.mark.parametrize("quantization", [None, "int8"])
def test_abstract_state_is_the_loaded_states_shapes(tiny_llama_gqa, quantization):
    kw = engine_kwargs(quantization=quantization, enable_lora=True, max_lora_rank=8)
    config = EngineArgs(model=tiny_llama_gqa[0], **kw).create_engine_config()
    mesh = make_mesh(1)
    args = (config.model_config, mesh, config.parallel_config, config.lora_config)
    graphdef, loaded = load_model(*args)
    abstract_graphdef, abstract = abstract_model(*args)
    assert abstract_graphdef == graphdef
    flat_loaded, flat_abstract = dict(loaded.flat_state()), dict(abstract.flat_state())
    assert set(flat_abstract) == set(flat_loaded)
    assert any(str(k[-1]).endswith("_lora_a") for k in flat_abstract)
    for key, var in flat_loaded.items():
        x, a = var.value, flat_abstract[key].value
        assert isinstance(a, jax.ShapeDtypeStruct)
        assert (a.shape, a.dtype, a.sharding) == (x.shape, x.dtype, x.sharding), key
