"""A request's structured-output fields as one StructuredOutputsParams.

Clients ask in three spellings, all read here: OpenAI's `response_format` (`text`,
`json_object`, `json_schema`), vLLM's `structured_outputs` object, and vLLM's older
`guided_json` / `guided_regex` / `guided_choice` / `guided_grammar` fields (with
`guided_decoding_backend` and `guided_whitespace_pattern`). A request may use one of them; every
mistake is a 400 naming the field.
"""

from __future__ import annotations

from typing import Any

from jaxserve.entrypoints.openai.protocol import bad_request
from jaxserve.sampling_params import StructuredOutputsParams

_GUIDED = {
    "guided_json": "json",
    "guided_regex": "regex",
    "guided_choice": "choice",
    "guided_grammar": "grammar",
}


def structured_outputs_field(body: Any) -> str | None:
    """The request field that carries a constraint (None: unconstrained); a 400 when several do."""
    given = []
    response_format = getattr(body, "response_format", None)
    if response_format is not None and response_format.get("type", "text") != "text":
        given.append("response_format")
    if getattr(body, "structured_outputs", None) is not None:
        given.append("structured_outputs")
    given += [name for name in _GUIDED if getattr(body, name, None) is not None]
    if len(given) > 1:
        raise bad_request(
            f"Give one structured-output constraint; this request has {', '.join(given)}.", given[1]
        )
    return given[0] if given else None


def structured_outputs_params(body: Any) -> StructuredOutputsParams | None:
    field = structured_outputs_field(body)
    if field is None:
        return None
    try:
        return StructuredOutputsParams(**_params_kwargs(body, field))
    except (TypeError, ValueError) as e:
        raise bad_request(f"{field}: {e}", field) from None


def _params_kwargs(body: Any, field: str) -> dict[str, Any]:
    common = {"backend": getattr(body, "guided_decoding_backend", None)}
    if getattr(body, "guided_whitespace_pattern", None) is not None:
        common["whitespace_pattern"] = body.guided_whitespace_pattern
    if field in _GUIDED:
        return {_GUIDED[field]: getattr(body, field), **common}
    if field == "structured_outputs":
        return {**common, **body.structured_outputs}
    return {**_response_format(body.response_format), **common}


def _response_format(value: dict[str, Any]) -> dict[str, Any]:
    """OpenAI's response_format: {"type": "json_object"} or {"type": "json_schema",
    "json_schema": {"name", "schema", "strict"}} (vLLM also reads "structural_tag", refused here)."""
    kind = value.get("type")
    if kind == "json_object":
        return {"json_object": True}
    if kind == "json_schema":
        spec = value.get("json_schema")
        if not isinstance(spec, dict):
            raise ValueError("type json_schema needs a json_schema object ({name, schema, strict}).")
        schema = spec.get("schema", spec.get("json_schema"))
        return {"json": schema if schema is not None else {"type": "object"}}
    raise ValueError(f"type must be 'text', 'json_object' or 'json_schema', got {kind!r}.")
