"""Errors that tell a user what to change."""


class ConfigError(ValueError):
    """A launch, environment or option value that cannot work; the message names what to change."""
