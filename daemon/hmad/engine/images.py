"""A request's images in its sequence: where their soft tokens sit, their features, what they mean for a step.

Gemma 3 puts an image into the prompt as ``<start_of_image>``, then ``mm_tokens_per_image`` soft tokens
(256) whose input embeddings are the vision tower's output, then ``<end_of_image>``
(model/vision_prompt.py). For the engine an image is an :class:`ImageSpan`: the positions of its soft
tokens, the digest of its file, and its features once encoded. Three rules follow:

- **Attention**: a soft token sees every soft token of its own image, later ones too (bidirectional within
  one image, causal otherwise, as Gemma 3 and llama.cpp's mtmd attend): ``visible``.
- **Chunks**: so that the whole image is in the KV cache when any of its rows attends, a prefill chunk
  never ends inside a span (``chunk_end``); the planner's chunk and the step's budget are at least a span.
- **The prefix cache**: a block is keyed by its token ids, and every soft token has the same id; so its
  key takes, in the soft tokens' places, words of the image's digest (negative, never a token id:
  ``key_ids``), and two images never share a cached block.

Features are cached by digest (``FeatureCache``), so a chat that resends an image does not encode it again.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from dataclasses import dataclass

import numpy as np

#: encoded images kept (a 27B's image is 256 x 5376 float32: 5.5 MB, so about 46 images)
CACHE_BYTES = 256 << 20
#: pixels of the images of requests still waiting, not yet encoded (896 x 896: 9.2 MiB an image, so 111)
WAITING_BYTES = 1 << 30


@dataclass
class ImageSpan:
    """One image of a sequence: soft tokens at positions ``start .. start + n - 1``."""

    start: int
    n: int
    digest: str  # sha256 hex of the image's file (model/images.py)
    pixels: np.ndarray | None = None  # (3, S, S) float32: the preprocessed image, until encoded
    features: np.ndarray | None = None  # (n, D) float32: the soft tokens' input embeddings, once encoded

    @property
    def end(self) -> int:
        """One past its last soft token."""
        return self.start + self.n


def visible(spans: list[ImageSpan], pos0: int, n: int) -> np.ndarray | None:
    """(n,) int32: the last position each row at ``pos0 .. pos0 + n - 1`` sees (its own, or its image's
    last soft token); None when no row lies in a span."""
    out, inside = np.arange(pos0, pos0 + n, dtype=np.int32), False
    for s in spans:
        lo, hi = max(s.start, pos0), min(s.end, pos0 + n)
        if lo < hi:
            out[lo - pos0 : hi - pos0] = s.end - 1
            inside = True
    return out if inside else None


def chunk_end(spans: list[ImageSpan], pos0: int, n: int) -> int:
    """How many of ``n`` positions from ``pos0`` a chunk takes so that it does not end inside a span: cut
    back to the span's start, or 0 when the chunk starts in (or at) a span it cannot hold whole."""
    end = pos0 + n
    for s in spans:
        if s.start < end < s.end:
            end = s.start
    return max(0, end - pos0)


def embeds(spans: list[ImageSpan], pos0: int, n: int) -> tuple[np.ndarray, np.ndarray] | None:
    """The rows (k,) of a part at ``pos0 .. pos0 + n - 1`` that are soft tokens, and their features (k, D);
    None when there are none. Every span it touches must be encoded."""
    rows, vals = [], []
    for s in spans:
        lo, hi = max(s.start, pos0), min(s.end, pos0 + n)
        if lo < hi:
            assert s.features is not None, "an image's rows planned before it was encoded"
            rows.append(np.arange(lo - pos0, hi - pos0, dtype=np.int32))
            vals.append(s.features[lo - s.start : hi - s.start])
    if not rows:
        return None
    return np.concatenate(rows), np.concatenate(vals)


def key_ids(token_ids: list[int], spans: list[ImageSpan]) -> list[int]:
    """The ids a prompt's prefix-cache keys are made of: its token ids, with each soft token replaced by a
    word of its image's digest (negative: never a token id), its offset mixed in."""
    out = list(token_ids)
    for s in spans:
        words = np.frombuffer(bytes.fromhex(s.digest)[:32].ljust(32, b"\0"), "<u4")
        for j in range(s.n):
            out[s.start + j] = -1 - int((int(words[j % len(words)]) ^ (j * 0x9E3779B1)) & 0x7FFFFFFF)
    return out


class FeatureCache:
    """Encoded images by digest, least recently used dropped past ``max_bytes``."""

    def __init__(self, max_bytes: int):
        self.max_bytes, self.bytes = max_bytes, 0
        self._items: OrderedDict[str, np.ndarray] = OrderedDict()
        self.hits = self.misses = 0

    def get(self, digest: str) -> np.ndarray | None:
        f = self._items.get(digest)
        if f is None:
            self.misses += 1
            return None
        self._items.move_to_end(digest)
        self.hits += 1
        return f

    def put(self, digest: str, features: np.ndarray) -> None:
        if digest in self._items or features.nbytes > self.max_bytes:
            return
        self._items[digest] = features
        self.bytes += features.nbytes
        while self.bytes > self.max_bytes:
            _, old = self._items.popitem(last=False)
            self.bytes -= old.nbytes

    def usage(self) -> dict[str, int]:
        return {"images": len(self._items), "bytes": self.bytes, "hits": self.hits, "misses": self.misses}


class ImageEncoder:
    """Gives every span its features: from the cache, else from ``encode`` ((n, 3, S, S) -> (n, N, D)),
    each distinct image once, in one call. The engine encodes a request's images when it is admitted, so
    only running requests hold features; the pixels of those still waiting are bounded by
    ``waiting_bytes`` (a request past it is answered ``busy``)."""

    def __init__(self, encode, cache_bytes: int = CACHE_BYTES, waiting_bytes: int = WAITING_BYTES):
        self.encode_fn, self.cache = encode, FeatureCache(cache_bytes)
        self.waiting_bytes = waiting_bytes
        self.encoded = 0  # images run through the encoder since start
        self.last_ms = 0.0  # the last encoder call's time

    def fits_waiting(self, spans: list[ImageSpan], waiting) -> bool:
        """Whether ``spans``' pixels fit beside those of the requests in ``waiting``."""
        held = sum(s.pixels.nbytes for r in waiting for s in r.images if s.pixels is not None)
        return held + sum(s.pixels.nbytes for s in spans if s.pixels is not None) <= self.waiting_bytes

    def waiting_message(self) -> str:
        return (
            f"the images of waiting requests fill the {self.waiting_bytes >> 20} MiB kept for them "
            "(vision.max_waiting_image_bytes); try again when some have started"
        )

    def encode(self, spans: list[ImageSpan]) -> None:
        todo: dict[str, list[ImageSpan]] = {}
        for s in spans:
            if s.features is None:
                s.features = self.cache.get(s.digest)
            if s.features is None:
                todo.setdefault(s.digest, []).append(s)
        if todo:
            t0 = time.perf_counter()
            feats = self.encode_fn(np.stack([group[0].pixels for group in todo.values()]))
            self.last_ms = round(1e3 * (time.perf_counter() - t0), 3)
            for (digest, group), f in zip(todo.items(), feats, strict=True):
                f = np.ascontiguousarray(f, np.float32)
                self.cache.put(digest, f)
                for s in group:
                    assert f.shape[0] == s.n, f"{f.shape[0]} soft tokens for a span of {s.n}"
                    s.features = f
            self.encoded += len(todo)
        for s in spans:
            s.pixels = None  # (features from here on)
