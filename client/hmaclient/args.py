"""Command-line argument types that hmactl and the daemon's CLI (``hmad generate``) share: one rule each."""

from __future__ import annotations

import argparse
import json
from typing import Any


def json_schema_arg(value: str) -> dict[str, Any]:
    """``--json-schema``: the JSON text of a schema (it starts with ``{``) or a file holding it -> a dict.

    Raises argparse.ArgumentTypeError (a usage error, exit 2) naming what is wrong.
    """
    text = value
    if not value.lstrip().startswith("{"):
        try:
            with open(value, encoding="utf-8") as f:
                text = f.read()
        except OSError as e:
            raise argparse.ArgumentTypeError(f"cannot read the schema file {value!r}: {e.strerror}") from None
    try:
        schema = json.loads(text)
    except json.JSONDecodeError as e:
        raise argparse.ArgumentTypeError(f"the schema is not JSON: {e}") from None
    if not isinstance(schema, dict):
        raise argparse.ArgumentTypeError(f"a JSON Schema here is a JSON object, got {type(schema).__name__}")
    return schema
