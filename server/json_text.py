"""The one reader of JSON text that a request carries *inside* a field (a tool call's `arguments`, a tool message's
content, a Responses `function_call.arguments` / `function_call_output.output`), bounded as the body itself is.

The body is parsed by pydantic's parser (jiter, in Rust) with a fixed nesting limit (about 200 levels) and no NaN or
infinity; `read_json` uses that same parser with the same settings, so a string inside a field can be no deeper than
the body that carried it, and no larger (it is part of that body, bounded by `--max-body-bytes`). Python's
`json.loads` has no such limit: 50,000 nested brackets in a string field raised RecursionError, a 500.
Every failure is an `InvalidRequest` (the API's 400) naming the field; `JSONTooDeep` is the nesting case, which a
caller that keeps unparsable text as text (a tool message's content) must still refuse.
"""

from __future__ import annotations

import math
from typing import Any

from pydantic_core import from_json

from server.errors import InvalidRequest


class JSONTextError(InvalidRequest):
    """The field's text is not a JSON document this server reads."""


class JSONTooDeep(JSONTextError):
    """The field's JSON is nested deeper than a request body may be."""


def read_json(text: str | bytes, param: str) -> Any:
    """The JSON value of `text` (a field named `param`); JSONTextError if it is not valid JSON, nested deeper than a
    body may be, or holds a number too large to be finite."""
    try:
        value = from_json(text, allow_inf_nan=False, cache_strings=False)
    except ValueError as exc:
        reason = str(exc)
        error = JSONTooDeep if "recursion limit" in reason else JSONTextError
        raise error(f"{param}: not valid JSON: {reason}", param) from None
    if not finite(value):  # "1e999" parses to inf even with allow_inf_nan=False; JSON cannot carry it back out
        raise JSONTextError(f"{param}: not valid JSON: a number is too large to be finite", param)
    return value


def finite(value: Any) -> bool:
    """No infinite or NaN float anywhere in a parsed JSON `value` (recursion bounded: the parser refused anything
    deeper). The body's validator (server.api.http) asks the same of untyped fields."""
    if isinstance(value, float):
        return math.isfinite(value)
    if isinstance(value, dict):
        return all(finite(item) for item in value.values())
    if isinstance(value, list):
        return all(finite(item) for item in value)
    return True
