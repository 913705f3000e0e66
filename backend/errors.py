"""ConfigError, the error a deployment's settings raise: the engine config's checks, the parallel layout's and the
deployment's. It lives in a module that imports nothing of the backend, so each of them raises it without importing
the others (backend/config.py imports the model's config.json keys; the model imports the parallel layout)."""


class ConfigError(ValueError):
    """A configuration value is invalid; the message names the parameter."""
