"""The errors bad settings and bad input raise, in a module that imports nothing of the backend, so that every part
raises them without importing the others: ConfigError, a deployment's settings (backend/config.py imports the model's
config.json keys; the model imports the parallel layout); `load_json`, a request's JSON inputs (the Triton inputs and
the structured-output constraints inside them)."""

import json
from typing import Any


class ConfigError(ValueError):
    """A configuration value is invalid; the message names the parameter."""


def load_json(text: str, what: str) -> Any:
    """`text` parsed as JSON; ValueError naming `what` if it is not JSON, or nests deeper than Python's parser goes."""
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValueError(f"{what} is not valid JSON: {exc}") from None
    except RecursionError:
        raise ValueError(f"{what} nests too deeply") from None
