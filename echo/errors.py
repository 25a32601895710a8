"""The one error type users see for bad input: it names the file, the key and the reason."""

from __future__ import annotations


class ConfigError(ValueError):
    """Bad configuration, reported before any expensive work starts."""

    def __init__(self, file: str, key: str, reason: str):
        self.file, self.key, self.reason = str(file), key, reason
        super().__init__(f"{self.file}: {key}: {reason}")
