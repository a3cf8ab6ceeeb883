"""Errors the user can fix: the CLI prints the message as one line and exits with status 2."""


class BackendError(ValueError):
    """A model that cannot be found or loaded, an unknown decoder, a prompt that does not fit."""


class ConfigError(ValueError):
    """A config value the user must change; the message names the key and the fix."""


class OutputError(ValueError):
    """An output that cannot be written (no space, no permission, a folder another run holds); the
    message names the path and what to do, and what was written before it stays valid."""
