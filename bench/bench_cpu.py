"""CPU speed of the numpy backend beside llama.cpp (llama-cpp-python), measured in one run.

    python3 bench/bench_cpu.py [--model default] [--threads 2] [--prefill 512] [--decode 64] [--json out.json]

Prefill: one prompt of N tokens, time to its first logits. Decode: batch-1 greedy tokens/s after a short
prompt. Both engines run the same GGUF on the same cores, one after the other; the report gives each
figure and hmad's ratio to llama.cpp. llama-cpp-python is optional (its figures are skipped without it).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import time

import numpy as np

from hmad.composition import load_model
from hmad.engine.generate import generate
from hmad.engine.sampling import SamplingParams
from hmad.engine.scheduler import SchedulerConfig
from hmad.model.loader import resolve_model_path


def prompt_ids(tokenizer, n: int) -> list[int]:
    text = " ".join(f"item {i}: the quick brown fox jumps over the lazy dog." for i in range(n))
    return tokenizer.encode(text)[:n]


def hmad_prefill(model, ids: list[int]) -> float:
    cfg = SchedulerConfig(max_seqs=1, step_tokens=len(ids), max_chunk=len(ids), kv_tokens=len(ids) + 8)
    t = time.perf_counter()
    generate(model, [ids], SamplingParams(temperature=0.0, max_tokens=1), cfg)
    return len(ids) / (time.perf_counter() - t)


def hmad_decode(model, ids: list[int], n: int) -> float:
    res = generate(model, [ids], SamplingParams(temperature=0.0, max_tokens=n))[0]
    return res.stats["tokens_per_s"]


def llama_prefill(llm, ids: list[int]) -> float:
    llm.reset()
    t = time.perf_counter()
    llm.eval(ids)
    return len(ids) / (time.perf_counter() - t)


def llama_decode(llm, ids: list[int], n: int) -> float:
    llm.reset()
    llm.eval(ids)
    tok = 0
    t = time.perf_counter()
    for _ in range(n):
        logits = np.ctypeslib.as_array(llm._ctx.get_logits_ith(-1), shape=(llm.n_vocab(),))
        tok = int(logits.argmax())
        llm.eval([tok])
    return n / (time.perf_counter() - t)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="default")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--prefill", type=int, default=512)
    ap.add_argument("--decode", type=int, default=64)
    ap.add_argument("--numerics", default="ggml", choices=["ggml", "f32"], help="the CPU backend's numerics")
    ap.add_argument("--json")
    a = ap.parse_args()
    path = resolve_model_path(a.model)
    model = load_model(path, backend="cpu", numerics=a.numerics)
    ids = prompt_ids(model.tokenizer, a.prefill)
    short = ids[:16]
    hmad_prefill(model, ids[:64])  # warm-up
    out = {
        "device": f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores",
        "model": str(path),
        "numerics": a.numerics,
        "date": time.strftime("%Y-%m-%d"),
        "hmad": {
            "prefill_tok_s": hmad_prefill(model, ids),
            "decode_tok_s": hmad_decode(model, short, a.decode),
        },
    }
    try:
        import llama_cpp
    except ImportError:
        llama_cpp = None
    if llama_cpp:
        from hmad.model.default import DEFAULT_NAME, assemble_default_model

        one = assemble_default_model() if a.model == DEFAULT_NAME else path  # llama.cpp reads one file
        llm = llama_cpp.Llama(
            str(one), n_ctx=a.prefill + a.decode + 64, n_batch=a.prefill, n_threads=a.threads, verbose=False
        )
        llama_prefill(llm, ids[:64])
        out["llama.cpp"] = {
            "version": llama_cpp.__version__,
            "prefill_tok_s": llama_prefill(llm, ids),
            "decode_tok_s": llama_decode(llm, short, a.decode),
        }
        out["ratio"] = {k: out["hmad"][k] / out["llama.cpp"][k] for k in ("prefill_tok_s", "decode_tok_s")}
    print(json.dumps(out, indent=1))
    if a.json:
        with open(a.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
