"""Structured output in a request body: OpenAI's `response_format` and vLLM's `guided_*` extra fields, read into
`GuidedDecodingParams` and checked (compiled without the tokenizer) before the request is admitted.

| body field | GuidedDecodingParams |
| --- | --- |
| `response_format: {"type": "json_object"}` | `json_object=True` |
| `response_format: {"type": "json_schema", "json_schema": {"name", "schema", "strict"}}` | `json=schema` |
| `response_format: {"type": "text"}` | none |
| `guided_json` (a schema, or its text), `guided_regex`, `guided_choice` (strings), `guided_grammar` (Lark/GBNF) | the field of the same name |
| `structured_outputs: {"json" / "regex" / "choice" / "grammar" / "json_object": ...}` (vLLM's newer form) | the same |

At most one of them may be given. Every bad value is an `APIError(400)` naming the field, with the grammar
library's message for a schema, regex or grammar it cannot compile. A choice holds at most `MAX_GUIDED_CHOICES`
(1,024) strings of `MAX_GUIDED_CHOICE_BYTES` (64 KiB) together.
"""

from __future__ import annotations

from minfer.sampling_params import GuidedDecodingParams
from minfer.serve.protocol import APIError, echo

_GUIDED_FIELDS = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice",
                  "guided_grammar": "grammar"}


def _response_format(rf) -> GuidedDecodingParams | None:
    if not isinstance(rf, dict) or not isinstance(rf.get("type"), str):
        raise APIError(400, "response_format must be an object with a 'type' (text, json_object or json_schema)",
                       param="response_format")
    kind = rf["type"]
    if kind == "text":
        return None
    if kind == "json_object":
        return GuidedDecodingParams(json_object=True)
    if kind == "json_schema":
        js = rf.get("json_schema")
        if not isinstance(js, dict):
            raise APIError(400, "response_format json_schema needs 'json_schema': {\"name\": ..., \"schema\": {...}}",
                           param="response_format")
        schema = js.get("schema", js.get("json_schema"))
        if schema is None:  # OpenAI allows omitting it (any JSON); a schema given as the object itself is
            schema = {"type": "object"}  # not OpenAI's shape
        if not isinstance(schema, (dict, bool)):
            raise APIError(400, f"response_format.json_schema.schema must be an object, got {echo(schema)}",
                           param="response_format")
        return GuidedDecodingParams(json=schema)
    raise APIError(400, f"response_format type must be text, json_object or json_schema, got {echo(kind)}",
                   param="response_format")


def guided_decoding_params(body: dict) -> tuple[GuidedDecodingParams | None, str | None]:
    """(the body's structured-output constraint or None, the field it came from).

    Raises:
        APIError(400): a malformed field, more than one of them, or a schema/regex/grammar that does not
            compile (checked here, before admission).
    """
    found: list[tuple[str, GuidedDecodingParams]] = []
    if body.get("response_format") is not None:
        g = _response_format(body["response_format"])
        if g is not None:
            found.append(("response_format", g))
    for name, field in _GUIDED_FIELDS.items():
        if body.get(name) is not None:
            found.append((name, _make(name, **{field: body[name]})))
    if body.get("structured_outputs") is not None:
        so = body["structured_outputs"]
        if not isinstance(so, dict):
            raise APIError(400, "structured_outputs must be an object such as {\"json\": {...}}",
                           param="structured_outputs")
        keys = {k: v for k, v in so.items() if k in ("json", "regex", "choice", "grammar", "json_object")}
        found.append(("structured_outputs", _make("structured_outputs", **keys)))
    if not found:
        return None, None
    if len(found) > 1:
        raise APIError(400, f"give one structured-output constraint, got {', '.join(n for n, _ in found)}",
                       param=found[1][0])
    name, guided = found[0]
    check(guided, name)
    return guided, name


# A choice is compiled into a grammar with one branch per string, and its token masks grow with them: 10^5
# choices ran 150 s without an answer. Classification labels, what guided_choice is for, are far fewer; 1,024
# choices of 27 characters answered in 3.4 s with SmolLM2 on a 2-core CPU, as fast as 64 did.
MAX_GUIDED_CHOICES = 1024  # strings
MAX_GUIDED_CHOICE_BYTES = 64 * 2**10  # UTF-8 bytes of all of them together


def check_choice(choice, param: str) -> None:
    """APIError(400, param=param) for a choice of more than `MAX_GUIDED_CHOICES` strings or of more than
    `MAX_GUIDED_CHOICE_BYTES` UTF-8 bytes together; checked before anything is compiled (the rest of its shape
    is `GuidedDecodingParams`'s to check)."""
    if not isinstance(choice, (list, tuple)):
        return
    if len(choice) > MAX_GUIDED_CHOICES:
        raise APIError(400, f"{param} has {len(choice)} choices; the server takes at most {MAX_GUIDED_CHOICES}",
                       param=param)
    size = sum(len(c.encode("utf-8", "surrogatepass")) for c in choice if isinstance(c, str))
    if size > MAX_GUIDED_CHOICE_BYTES:
        raise APIError(400, f"{param} holds {size} bytes of choices; the server takes at most "
                            f"{MAX_GUIDED_CHOICE_BYTES} bytes together", param=param)


def _make(param: str, **fields) -> GuidedDecodingParams:
    if "choice" in fields:
        check_choice(fields["choice"], param)
    try:
        return GuidedDecodingParams(**fields)
    except (ValueError, TypeError) as exc:
        raise APIError(400, str(exc).replace("SamplingParams.guided_decoding", param), param=param) from None


def check(guided: GuidedDecodingParams, param: str) -> None:
    """Compile `guided` (no tokenizer needed); APIError(400, param=param) with the library's message if it
    does not compile, or 400 if the server has no grammar library."""
    from minfer.structured_output import validate_grammar

    try:
        validate_grammar(guided)
    except ValueError as exc:
        raise APIError(400, str(exc), param=param) from None
