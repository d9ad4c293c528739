"""The sampling fields as pydantic types, built from their one table (``hmaclient.sampling``).

The engine's ``SamplingParams.validate``, the YAML config's ``sampling:`` section and the OpenAI gateway's
request bodies all take their types from here, so a bound is written once (in the table) and turned into
pydantic once (here). Types are strict: an int field takes ints only, a number field ints or finite floats,
no bools; a list of stop strings holds at most the table's count of non-empty strings; logit_bias is a map
checked entry by entry by the table's own rule (``hmaclient.sampling.problem``).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Annotated, Any

import pydantic

from hmaclient import sampling as fields


def field_type(f: fields.SamplingField) -> Any:
    """The pydantic type of one field (``| None`` where None is a value of its own: seed); its description
    is what the field allows, in the table's words ("a number in (0, 1]")."""
    says = pydantic.Field(description=fields.describe(f))
    if f.kind == "bias":  # its entries checked by the table's own rule, in the wire's words
        return Annotated[dict[Any, Any], pydantic.AfterValidator(_bias_check(f)), says]
    if f.kind == "strings":
        text = Annotated[str, pydantic.Field(min_length=1, max_length=fields.MAX_STOP_CHARS)]
        return Annotated[list[text], pydantic.Field(max_length=int(f.hi)), says]
    lo = {"gt" if f.lo_open else "ge": f.lo}
    kind = int if f.kind == "int" else float
    typ = Annotated[kind, pydantic.Field(**lo, le=f.hi, allow_inf_nan=False, strict=True)]
    return Annotated[typ | None, says] if f.nullable else Annotated[typ, says]


def _bias_check(f: fields.SamplingField) -> Any:
    def check(v: dict) -> dict:
        wrong = fields.problem(f.name, v)
        if wrong:
            raise ValueError(wrong)
        return v

    return check


def sampling_model(name: str, defaults: Mapping[str, Any], **config: Any) -> type[pydantic.BaseModel]:
    """A strict pydantic model of every sampling field with ``defaults``, refusing unknown keys;
    ``config``: more model options (the config's section is frozen)."""
    given = {k: _plain(v) for k, v in defaults.items()}
    spec = {f.name: (field_type(f), given[f.name]) for f in fields.FIELDS}
    options = pydantic.ConfigDict(strict=True, extra="forbid", **config)
    return pydantic.create_model(name, __config__=options, **spec)


def _plain(v: Any) -> Any:
    """A default as the model keeps it: stop's tuple a list, logit_bias's read-only map a dict."""
    return list(v) if isinstance(v, tuple) else dict(v) if isinstance(v, Mapping) else v


def message(e: pydantic.ValidationError, values: Mapping[str, Any]) -> tuple[str, str]:
    """(field, the wire's wording of what is wrong: "top_p must be a number in (0, 1], got 1.5") of the first
    error of a sampling model; ``values``: what was validated."""
    err = e.errors()[0]
    name = str(err["loc"][0])
    value = values.get(name, err.get("input"))
    return name, fields.problem(name, value) or f"{name}: {err['msg']}"
