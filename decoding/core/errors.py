"""Errors the user can fix: the CLI prints the message as one line and exits with status 2."""


class BackendError(ValueError):
    """A model that cannot be found or loaded, an unknown decoder, a prompt that does not fit."""


class ConfigError(ValueError):
    """A config value the user must change; the message names the key and the fix."""
