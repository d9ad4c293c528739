"""What structured output costs per token: the json_schema mask on a real vocabulary (no model weights run).

    python bench/bench_structured.py [--gguf PATH] [--tokens N] [--out FILE.json]

Default vocabulary: the embedded Gemma 3 270M's (262,144 tokens). For each schema it walks a real token
sequence through a JsonConstraint, timing every step's parts:

    mask     JsonConstraint.mask(logits), all the engine adds before sampling a constrained token:
             llguidance's mask into a packed bitmask (Rust), unpacked to a bool row, np.where on the row
    mask_cpu the same in this thread's CPU time (robust on a busy machine; llguidance runs in this thread)
    accept   JsonConstraint.accept(token) (llguidance's ``consume_token``)

Walks: ``document`` feeds the tokenizer's own encoding of a valid JSON answer (what a model writing well
would produce); ``random`` draws uniformly among the allowed tokens at each step (long strings of arbitrary
tokens: the slow case for a string's lexer). For scale it also times Sampler.sample on one 262k row
(temperature 0.8, top-p 0.95), what every sampled token already pays. Prints one JSON object.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "daemon"))

from hmad.engine.sampling import Sampler, SamplingParams  # noqa: E402
from hmad.engine.structured import JsonConstraint, Vocabulary, compile_schema  # noqa: E402
from hmad.model.loader import read_model_files, resolve_model_path  # noqa: E402

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 32},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "role": {"enum": ["admin", "editor", "viewer"]},
        "active": {"type": "boolean"},
        "skills": {"type": "array", "items": {"type": "string"}, "minItems": 1, "maxItems": 5},
        "address": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
            "required": ["city", "zip"],
        },
    },
    "required": ["name", "age", "role", "active", "skills", "address"],
}
DOCUMENT = {
    "name": "Ada Lovelace",
    "age": 36,
    "role": "editor",
    "active": True,
    "skills": ["mathematics", "poetry", "engines"],
    "address": {"city": "London", "zip": "12345"},
}
SCHEMAS = {"person": (PERSON, DOCUMENT), "any_object": ({"type": "object"}, DOCUMENT)}


def walk(vocab, schema, tokens: list[int] | None, n: int, rng) -> dict[str, list[float]]:
    """Times of each step's parts along ``tokens`` (or random allowed tokens when None), up to ``n``."""
    c = JsonConstraint(compile_schema(schema), vocab)
    logits = rng.standard_normal(vocab.size).astype(np.float32)
    times: dict[str, list[float]] = {"mask": [], "mask_cpu": [], "accept": []}
    for i in range(n if tokens is None else len(tokens)):
        t0, c0 = time.perf_counter(), time.thread_time()
        masked = c.mask(logits)
        t1, c1 = time.perf_counter(), time.thread_time()
        ids = np.flatnonzero(np.isfinite(masked))
        ids = ids[~np.isin(ids, vocab.eos_ids)]
        if tokens is None and not ids.size:
            break
        token = int(rng.choice(ids)) if tokens is None else tokens[i]
        t2 = time.perf_counter()
        c.accept(token)
        times["mask"].append(t1 - t0)
        times["mask_cpu"].append(c1 - c0)
        times["accept"].append(time.perf_counter() - t2)
        if c.stopped:
            break
    return times


def summary(xs: list[float]) -> dict[str, float]:
    a = np.asarray(xs) * 1e6
    return {
        "n": int(a.size),
        "mean_us": round(float(a.mean()), 1),
        "p50_us": round(float(np.median(a)), 1),
        "p99_us": round(float(np.percentile(a, 99)), 1),
        "max_us": round(float(a.max()), 1),
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gguf", default="default", help="model whose vocabulary to use (default: the 270M)")
    ap.add_argument("--tokens", type=int, default=200, help="steps of each random walk")
    ap.add_argument("--out", help="also write the JSON here")
    args = ap.parse_args()
    tok = read_model_files(resolve_model_path(args.gguf)).tokenizer
    t0 = time.perf_counter()
    vocab = Vocabulary.of(tok)
    out: dict = {"vocab_size": tok.vocab_size, "vocabulary_build_s": round(time.perf_counter() - t0, 3)}
    rng = np.random.default_rng(0)
    for name, (schema, doc) in SCHEMAS.items():
        for mode, tokens in (("document", tok.encode(json.dumps(doc), add_bos=False)), ("random", None)):
            times = walk(vocab, schema, tokens, args.tokens, rng)
            out[f"{name}/{mode}"] = {part: summary(ts) for part, ts in times.items()}
    row = rng.standard_normal(tok.vocab_size).astype(np.float32)
    sampler = Sampler(SamplingParams(temperature=0.8, top_p=0.95, seed=0))
    ts = []
    for _ in range(50):
        t = time.perf_counter()
        sampler.sample(row)
        ts.append(time.perf_counter() - t)
    out["sampler_sample_T0.8_top_p0.95"] = summary(ts)
    text = json.dumps(out, indent=1)
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
