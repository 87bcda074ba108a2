"""The request fields that constrain the output (response_format, structured_outputs,
guided_*), and their errors in the request's own terms."""

from __future__ import annotations

import dataclasses
from typing import Any

from slotserve.sampling import SamplingParams
from slotserve.server.protocol.errors import APIError
from slotserve.server.protocol.request_model import RequestModel
from slotserve.structured import StructuredOutputs, from_response_format


class StructuredFields(RequestModel):
    """The ways to constrain the output (exactly one at most): OpenAI's `response_format`,
    vLLM's `structured_outputs` ({json | regex | choice | grammar | json_object}) and its
    older `guided_json`, `guided_regex`, `guided_choice`, `guided_grammar`."""

    response_format: dict[str, Any] | None = None
    structured_outputs: dict[str, Any] | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None

    def structured_spec(self) -> tuple[StructuredOutputs | None, str | None]:
        """(what the output must match, the request field that says so); (None, None) when
        unconstrained. APIError (400) naming the field when it is malformed or when more than
        one field constrains the output."""
        found = []
        for param in ("response_format", "structured_outputs", *_GUIDED):
            value = getattr(self, param)
            if value is None:
                continue
            try:
                spec = _structured_from(param, value)
            except ValueError as exc:
                raise APIError(_renamed(str(exc), param), param=param) from exc
            if spec is not None:
                found.append((spec, param))
        if len(found) > 1:
            names = ", ".join(param for _, param in found)
            raise APIError(f"only one of response_format, structured_outputs and guided_* "
                           f"may constrain the output; got {names}", param=found[1][1])
        return found[0] if found else (None, None)


# guided_* field -> the StructuredOutputs field it sets (vLLM's older names)
_GUIDED = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice",
           "guided_grammar": "grammar"}


def _structured_from(param: str, value: Any) -> StructuredOutputs | None:
    if param == "response_format":
        return from_response_format(value)
    if param == "structured_outputs":
        return StructuredOutputs.from_dict(value)
    return StructuredOutputs(**{_GUIDED[param]: value})


def _renamed(message: str, param: str) -> str:
    """A StructuredOutputs message ("structured_outputs.json: ...") in the request's terms."""
    if param in _GUIDED:
        return message.replace(f"structured_outputs.{_GUIDED[param]}", param, 1)
    return message


def structured_error(message: str, param: str) -> APIError:
    """The grammar engine rejected a request's constraint (ValueError "structured_outputs.
    <kind>: ..."): a 400 naming the request field that carried it."""
    prefix, _, rest = message.partition(":")
    if param == "response_format" and prefix == "structured_outputs.json":
        message = f"response_format.json_schema.schema:{rest}"
    elif param in _GUIDED:
        message = _renamed(message, param)
    elif param == "structured_outputs" or not prefix.startswith("structured_outputs"):
        pass
    else:  # tools: the schema built from the tools' parameters
        message = f"{param}: the function parameters schema was rejected:{rest}"
    return APIError(message, param=param)


def with_structured(params: SamplingParams, spec: StructuredOutputs | None) -> SamplingParams:
    """`params` constrained to `spec` (unchanged when None)."""
    if spec is None:
        return params
    return dataclasses.replace(params, structured_outputs=spec)

