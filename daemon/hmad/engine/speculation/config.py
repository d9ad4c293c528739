"""What speculation does: the ``speculation:`` section of the daemon's config (hmad/config.py mirrors these
fields with their ranges; etc/hmad.yaml documents them)."""

from __future__ import annotations

from dataclasses import dataclass

MODES = ("off", "lookup", "draft")


@dataclass(frozen=True)
class SpeculationConfig:
    mode: str = "off"  # off | lookup (prompt lookup: engine/speculation/lookup.py) | draft (draft_model.py)
    draft_model: str = "default"  # mode draft: a GGUF path, default (the embedded 270M) or a pulled model
    k_max: int = 8  # most draft tokens a sequence checks in one step (also < engine.max_chunk)
    ngram_min: int = 1  # shortest suffix of the sequence looked up (llama.cpp's lookup, vLLM's ngram)
    ngram_max: int = 3  # longest; the longest suffix that occurs earlier wins
    max_batch: int = 8  # speculate only while at most this many sequences run (backs off as the batch grows)

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"speculation.mode must be one of {', '.join(MODES)}, got {self.mode!r}")
        if not 1 <= self.ngram_min <= self.ngram_max:
            raise ValueError(
                f"speculation needs 1 <= ngram_min <= ngram_max, got {self.ngram_min} and {self.ngram_max}"
            )

    @property
    def on(self) -> bool:
        return self.mode != "off"
