"""Speculative decoding (docs/speculation.md): a drafter proposes the next tokens of a decoding sequence,
one step of the target checks them all, and the sequence keeps the longest prefix the target agrees with.

- ``config``: ``SpeculationConfig`` (the config's ``speculation:`` section).
- ``lookup``: the ``Drafter`` interface and prompt lookup (n-gram matches in the prompt and the output).
- ``speculator``: which sequences speculate, the drafts of a step, their verification and KV rollback, the
  adaptive k and the counters status shows.
"""

from hmad.engine.speculation.config import SpeculationConfig
from hmad.engine.speculation.lookup import Drafter, LookupDrafter
from hmad.engine.speculation.speculator import Speculator

__all__ = ["Drafter", "LookupDrafter", "SpeculationConfig", "Speculator"]
