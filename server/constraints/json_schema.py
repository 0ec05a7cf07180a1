"""`response_format` (`json_object`, `json_schema`) as a grammar: the schema, checked against the limits, handed to
llguidance's own JSON-schema compiler (`%json {...}` in Lark). A thought channel before it is the planner's business."""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from server.constraints.constraint import ConstraintError

if TYPE_CHECKING:
    from server.constraints.vocab import ConstraintLimits


def json_grammar(response_format: Mapping[str, Any], limits: ConstraintLimits) -> str:
    """The Lark body (a `start` rule's right-hand side) for a `json_object` / `json_schema` response_format."""
    if response_format["type"] == "json_object":
        schema: Any = {"type": "object"}
    else:
        spec = response_format.get("json_schema")
        if not isinstance(spec, Mapping) or not isinstance(spec.get("schema", {}), Mapping):
            raise ConstraintError("response_format.json_schema must be an object with a 'schema' object", "response_format")
        schema = dict(spec.get("schema") or {})
    text = json.dumps(schema)
    if len(text) > limits.max_spec_chars:
        raise ConstraintError(f"response_format schema is {len(text)} characters; the limit is {limits.max_spec_chars}",
                              "response_format")
    # Compact separators and no free whitespace: a weak (or random) model cannot fill its budget with blanks.
    guidance = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": ", "lenient": False}
    return f"%json {json.dumps({**schema, 'x-guidance': guidance})}"
