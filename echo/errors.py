"""The error types users see: bad input names the file, the key and the reason; a damaged artifact
names the file, what is wrong and how to rebuild it."""

from __future__ import annotations


class ConfigError(ValueError):
    """Bad configuration, reported before any expensive work starts."""

    def __init__(self, file: str, key: str, reason: str):
        self.file, self.key, self.reason = str(file), key, reason
        super().__init__(f"{self.file}: {key}: {reason}")


class ArtifactError(RuntimeError):
    """An artifact on disk that is not what its stage wrote: truncated, damaged (its checksums
    fail) or of another contract (columns missing or of another type)."""

    def __init__(self, path: str, problem: str, fix: str):
        self.path, self.problem, self.fix = str(path), problem, fix
        super().__init__(f"{self.path}: {problem}; {fix}")
