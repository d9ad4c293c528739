"""The store's one error: a refusal or failure whose message is written for the user."""

from __future__ import annotations

from hmad.core.errors import HmadError


class StoreError(HmadError):
    """A pull, listing or removal that cannot be done: the message says why and what to do."""
