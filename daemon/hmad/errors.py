"""Named errors shared across the daemon."""

from __future__ import annotations

from pathlib import Path


class HmadError(Exception):
    """Base class of every error hmad raises on purpose."""


class ModelFormatError(HmadError):
    """A model file is corrupt or unsupported. The message names the file and the problem."""

    def __init__(self, path: str | Path, problem: str):
        self.path = str(path)
        self.problem = problem
        super().__init__(f"{self.path}: {problem}")


class ModelNotFoundError(HmadError):
    """The model named by the user does not resolve to a file or checkpoint directory."""


class UnsupportedArchitectureError(HmadError):
    """The model's architecture has no entry in the registry."""
