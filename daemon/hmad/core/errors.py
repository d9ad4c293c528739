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


class UnencodableText(HmadError, ValueError):
    """Text the tokenizer cannot turn into ids: a character is no token and the vocabulary has no
    byte-fallback token for one of its UTF-8 bytes. The server answers that request ``bad_request``."""


class BackendUnusable(HmadError):
    """Raised (or subclassed) by a backend whose device can run no further step (e.g. Vulkan's
    VK_ERROR_DEVICE_LOST). The engine then answers every request ``internal`` and the daemon exits 1 so its
    supervisor restarts it; any other exception from a step fails only that step's requests."""
