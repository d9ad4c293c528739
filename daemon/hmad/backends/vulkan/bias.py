"""A step's additive logit adjustments on the device (``StepBatch.bias``: logit_bias, presence and frequency
penalties; engine/sampling.py, step 0), added to the logit rows by shaders/logit_bias.comp at the start of
every tail that picks or pre-selects tokens (argmax, top-k, draw: ``tails.add_bias``), never before the
copy tail (full rows go to the host, which adds the same deltas itself).

The entries travel in a host-visible buffer per parity (RecordContext.biases), written at launch beside the
parity's metadata: word 0 the count n, words 1-3 zero, then n (row, token, delta bits) triples
(``BIAS_DTYPE``). The shader reads them straight from there: a few KiB at most, once a step. A step with
more than :data:`BIAS_ENTRIES` entries cannot take a device tail (``bias_ok`` False: the engine reads its
full rows instead, engine/planning.py).
"""

from __future__ import annotations

import numpy as np

from hmad.core.batch import BIAS_DTYPE, StepBatch

# entries a step's device tails add at most: 300 logit_bias entries and ~100 penalised tokens for each of 64
# rows, in 384 KiB a parity
BIAS_ENTRIES = 32768
HEADER_WORDS = 4
BUFFER_WORDS = HEADER_WORDS + 3 * BIAS_ENTRIES
# workgroups of the grid-stride loop over the entries (most steps have none: one word read per invocation)
BIAS_GROUPS = 16


def pack(batch: StepBatch, out: np.ndarray) -> tuple[int, bool]:
    """``batch.bias`` into ``out`` (uint32, at least BUFFER_WORDS) in the buffer's layout: (words written,
    whether it fits: a step with too many entries gets a count of 0)."""
    entries = np.ascontiguousarray(batch.bias, BIAS_DTYPE)
    fits = len(entries) <= BIAS_ENTRIES
    n = len(entries) if fits else 0
    out[:HEADER_WORDS] = (n, 0, 0, 0)
    out[HEADER_WORDS : HEADER_WORDS + 3 * n] = entries[:n].view(np.uint32)
    return HEADER_WORDS + 3 * n, fits

