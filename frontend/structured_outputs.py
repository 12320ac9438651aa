"""A request's structured-output fields -> one `StructuredOutputsParams`, as vLLM reads them.

Three spellings, at most one per request:

- OpenAI's `response_format`: `{"type": "text"}` (no constraint), `{"type": "json_object"}`,
  `{"type": "json_schema", "json_schema": {"name", "schema", "strict"}}`, and vLLM's
  `{"type": "structural_tag", "structures": [...], "triggers": [...]}`;
- vLLM's `structured_outputs` object: json, regex, choice, grammar, json_object,
  structural_tag, whitespace_pattern, disable_any_whitespace, disable_additional_properties;
- the deprecated `guided_json` / `guided_regex` / `guided_choice` / `guided_grammar`
  (+ `guided_whitespace_pattern`), accepted with a warning in the log.

The constraint's `param` is the field the client used: `InputProcessor` (enginecore/processor.py) compiles
the constraint with the request's other checks (llguidance, no tokenizer, about a millisecond, cached), so a
bad schema, regex or grammar is a 400 naming that field.
"""

from __future__ import annotations

import dataclasses
import json
import logging

from enginecore.sampling_params import ENGINE_INTERNAL_STRUCTURED_FIELDS, SamplingParamsError, StructuredOutputsParams

logger = logging.getLogger("xlaserve.frontend")

GUIDED_FIELDS = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice",
                 "guided_grammar": "grammar"}
_STRUCTURED_KEYS = frozenset(f.name for f in dataclasses.fields(StructuredOutputsParams)) - \
    ENGINE_INTERNAL_STRUCTURED_FIELDS
# vLLM keys that choose among its own backends: nothing to choose here
_IGNORED_KEYS = {"disable_fallback", "backend", "_backend", "_backend_was_auto"}


def _from_response_format(rf) -> StructuredOutputsParams:
    if not isinstance(rf, dict):
        raise SamplingParamsError("response_format must be an object", "response_format")
    kind = rf.get("type", "text")
    if kind == "json_object":
        return StructuredOutputsParams(json_object=True, param="response_format")
    if kind == "json_schema":
        js = rf.get("json_schema")
        if not isinstance(js, dict):
            raise SamplingParamsError("response_format of type json_schema needs a json_schema object",
                                      "response_format")
        schema = js.get("schema", js.get("json_schema"))
        if schema is None:
            schema = {}  # OpenAI: the schema is optional; any JSON value then
        if not isinstance(schema, (dict, str)):
            raise SamplingParamsError("response_format.json_schema.schema must be a JSON schema object",
                                      "response_format")
        return StructuredOutputsParams(json=schema, param="response_format")
    if kind == "structural_tag":
        return StructuredOutputsParams(structural_tag=json.dumps(rf), param="response_format")
    raise SamplingParamsError(f"response_format type {kind!r} is not supported (text, json_object, json_schema, "
                              "structural_tag)", "response_format")


def _from_structured_outputs(d) -> StructuredOutputsParams:
    if not isinstance(d, dict):
        raise SamplingParamsError("structured_outputs must be an object", "structured_outputs")
    unknown = set(d) - _STRUCTURED_KEYS - _IGNORED_KEYS
    if unknown:
        raise SamplingParamsError(f"structured_outputs: unknown field(s) {', '.join(sorted(unknown))} "
                                  f"(known: {', '.join(sorted(_STRUCTURED_KEYS))})", "structured_outputs")
    kwargs = {k: v for k, v in d.items() if k in _STRUCTURED_KEYS and v is not None}
    if isinstance(kwargs.get("structural_tag"), dict):
        kwargs["structural_tag"] = json.dumps(kwargs["structural_tag"])
    return StructuredOutputsParams(**kwargs, param="structured_outputs")


def request_constraint(req) -> StructuredOutputsParams | None:
    """The request's constraint (its `param` naming the field it came in), None for none. Raises
    SamplingParamsError (400) naming the field for a malformed one; the input processor compiles it."""
    sources: list[tuple[str, object]] = []
    rf = req.response_format
    if rf is not None and not (isinstance(rf, dict) and rf.get("type", "text") == "text"):
        sources.append(("response_format", rf))
    so = req.structured_outputs
    if so is not None:
        sources.append(("structured_outputs", so))
    guided = {name: getattr(req, name) for name in GUIDED_FIELDS}
    guided = {k: v for k, v in guided.items() if v is not None}
    if guided:
        sources.append((next(iter(guided)), guided))
    if not sources:
        return None
    if len(sources) > 1:
        names = ", ".join(n for n, _ in sources)
        raise SamplingParamsError(f"give one structured-output constraint, not several ({names})", sources[1][0])
    field, value = sources[0]
    try:
        if field == "response_format":
            params = _from_response_format(value)
        elif field == "structured_outputs":
            params = _from_structured_outputs(value)
        else:
            logger.warning("request fields %s are deprecated (removed in vLLM): use structured_outputs "
                           "{json, regex, choice, grammar} or response_format", ", ".join(sorted(value)))
            if len(value) > 1:
                raise SamplingParamsError(f"give one of {', '.join(GUIDED_FIELDS)}, not several", field)
            params = StructuredOutputsParams(**{GUIDED_FIELDS[field]: value[field]},
                                             whitespace_pattern=req.guided_whitespace_pattern, param=field)
    except TypeError as e:
        raise SamplingParamsError(f"{field}: {e}", field) from None
    return params
