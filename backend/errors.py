"""The errors bad settings and bad input raise, in a module that imports nothing of the backend, so that every part
raises them without importing the others: ConfigError, a deployment's settings (backend/config.py imports the model's
config.json keys; the model imports the parallel layout); `load_json`, a request's JSON inputs (the Triton inputs and
the structured-output constraints inside them); `is_int` and `is_number`, what settings, config.json keys and requests'
numbers are checked against."""

import json
import math
from typing import Any


class ConfigError(ValueError):
    """A configuration value is invalid; the message names the parameter."""


# How deep a request's JSON may nest: well past any schema (64 levels, `MAX_SCHEMA_DEPTH`) or structural tag (128)
# inside the input, and well short of where the chat template's renderer, which recurses through the messages and
# tools, runs out of Python's stack (about 450 levels).
MAX_JSON_DEPTH = 200


def load_json(text: str, what: str) -> Any:
    """`text` parsed as JSON; ValueError naming `what` if it is not JSON, or nests deeper than MAX_JSON_DEPTH."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValueError(f"{what} is not valid JSON: {exc}") from None
    except RecursionError:  # (deeper than Python's parser goes)
        raise ValueError(f"{what} nests too deeply (more than {MAX_JSON_DEPTH} levels)") from None
    if (depth := json_depth(value)) > MAX_JSON_DEPTH:
        raise ValueError(f"{what} nests {depth} levels deep, more than {MAX_JSON_DEPTH}")
    return value


def json_depth(node: Any) -> int:
    """How deep `node`'s objects and lists nest (a scalar: 0), level by level (no recursion)."""
    depth, level = 0, [node]
    while level:
        level = [child for item in level if isinstance(item, (dict, list))
                 for child in (item.values() if isinstance(item, dict) else item)]
        depth += 1
    return depth - 1


def is_int(value) -> bool:
    """An int that is not a bool (json and Python both make True an int)."""
    return isinstance(value, int) and not isinstance(value, bool)


def is_number(value) -> bool:
    """A finite int or float, not a bool (json takes Infinity and NaN; no setting means either)."""
    return is_int(value) or isinstance(value, float) and math.isfinite(value)
