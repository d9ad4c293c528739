"""The prefix cache is partitioned by tenant (``Request.tenant``; engine/kvcache.py, "Tenants").

A request reuses, and reports in ``cached_tokens``, only blocks its own tenant computed: two tenants with the
same prompt each compute it (the second reports 0 and gets the same tokens), a tenant's second request
reuses its first's blocks as before. Tenant None (unknown or local) is a partition of its own, apart from
every uid, root's (0) included. The bookkeeping alone, then a real Scheduler over a tiny random GGUF on
the numpy backend.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np
import pytest
from daemon_harness import Daemon
from test_model_cpu import rand_ids
from tiny_gguf import MIXED, make_tiny_gguf

from hmad.composition import load_model
from hmad.engine.kvcache import ROOT_KEY, KVCacheManager, KVLayout, prompt_keys, tenant_root
from hmad.engine.request import Request
from hmad.engine.sampling import SamplingParams
from hmad.engine.scheduler import Scheduler, SchedulerConfig

B = 4
TENANTS = (None, 0, 1000, 1001)


def test_each_tenant_chains_from_its_own_root():
    ids = list(range(100, 116))
    roots = [tenant_root(t) for t in TENANTS]
    assert roots[0] == ROOT_KEY and len(set(roots)) == len(TENANTS)
    chains = [prompt_keys(ids, B, 4, r) for r in roots]
    assert chains[0] == prompt_keys(ids, B, 4)  # tenant None: the keys as before tenants
    assert len({k for c in chains for k in c}) == 4 * len(TENANTS)  # no key shared by two tenants


def kv_manager() -> KVCacheManager:
    lay = KVLayout(B, 64, 32, 4, (1,), (0,), 1, 8, window=6, max_seqs=4)
    return KVCacheManager(lay)


def write(kv: KVCacheManager, sid: int, ids: list[int], tenant: int | None) -> int:
    """Admit ``ids`` for ``tenant``, write them 4 positions a step and release; returns the positions
    reused."""
    reused = kv.admit(sid, len(ids) + 4, ids, tenant)
    assert reused is not None
    for p0 in range(reused, len(ids), B):
        n = min(B, len(ids) - p0)
        kv.prepare(sid, p0, n)
        kv.commit(sid, p0 + n, lambda a, b: ids[a:b])
    kv.release(sid)
    return reused


def test_kv_reuses_within_a_tenant_only():
    kv = kv_manager()
    ids = list(range(10, 31))  # 21 tokens: 5 full blocks, the last token always computed
    got = [write(kv, i, ids, t) for i, t in enumerate(TENANTS + TENANTS)]
    assert got == [0] * len(TENANTS) + [20] * len(TENANTS)
    st = kv.usage()["prefix_cache"]
    assert (st["lookups"], st["hits"]) == (8, 4)
    assert st["cached_blocks"] == 5 * len(TENANTS)  # each tenant's own copy


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = make_tiny_gguf(tmp_path_factory.mktemp("tenancy") / "tiny.gguf", seed=13, types=MIXED)
    return load_model(path, backend="cpu", deterministic=True)


def run(model, jobs: list[tuple[list[int], int | None]]) -> list[tuple[list[int], int]]:
    """One scheduler, the jobs (prompt, tenant) one after another; each one's (tokens, cached_tokens)."""
    # max_seqs 8: the local pool (R_s blocks a sequence) has room to keep both tenants' windows cached
    cfg = SchedulerConfig(max_seqs=8, step_tokens=8, max_chunk=8, block_size=B, kv_tokens=512)
    s, out = Scheduler(model, cfg), []
    for i, (ids, tenant) in enumerate(jobs):
        s.submit(Request(i, list(ids), SamplingParams(temperature=0.0, max_tokens=5), tenant=tenant))
        toks, cached = [], None
        while s.has_work():
            for ev in s.step():
                toks += ev.token_ids
                cached = ev.stats["cached_tokens"] if ev.kind == "done" else cached
        out.append((toks, cached))
    return out


def test_two_tenants_same_prompt_share_nothing_and_get_the_same_tokens(tiny):
    """Tenant 1001 sends tenant 1000's prompt: it reports 0 cached tokens (it cannot tell that 1000 sent
    it) and gets the same tokens; each tenant's second request reuses its own first's prefix."""
    ids = rand_ids(np.random.default_rng(0), 30, tiny.config.vocab_size)
    (t0, c0), (t1, c1), (t2, c2), (t3, c3) = run(tiny, [(ids, 1000), (ids, 1001), (ids, 1000), (ids, 1001)])
    assert (c0, c1) == (0, 0)
    assert c2 == c3 == 28  # 7 full blocks of the 30-token prompt (the last token is always computed)
    assert t0 == t1 == t2 == t3 and len(t0) > 0


def test_unknown_tenant_is_its_own_partition(tiny):
    """A request of unknown tenant (None: in-process, or credentials not read) neither reuses root's (0)
    blocks nor lends its own; None's second request reuses None's first, as the cache did before tenants."""
    ids = rand_ids(np.random.default_rng(1), 22, tiny.config.vocab_size)
    got = run(tiny, [(ids, 0), (ids, None), (ids, None), (ids, 0)])
    assert [c for _, c in got] == [0, 0, 20, 20]
    assert len({tuple(t) for t, _ in got}) == 1


# -- through a real daemon, as two users ------------------------------------------------------------------

NOBODY = 65534
# hmactl as nobody: the interpreter starts as root (it may live where nobody cannot read), then drops
_AS_NOBODY = f"""
import os, sys, shutil, asyncio, asyncio.unix_events, json, zmq.asyncio
from hmaclient import cli
cli.build_parser().format_help()  # argparse's lazy imports, while the files can still be read
os.setgroups([]); os.setgid({NOBODY}); os.setuid({NOBODY})
sys.exit(cli.main(sys.argv[1:]))
"""
PROMPT = "the cat and the dog and the model of the world " * 6


def query(socket: str, as_nobody: bool) -> dict:
    """``hmactl query --json`` of PROMPT (greedy, raw, 4 tokens), run as root or as nobody."""
    args = ["--socket", socket, "query", "--raw", "--json", "--max-tokens", "4", "--temperature", "0", PROMPT]
    cmd = [sys.executable, *(["-c", _AS_NOBODY] if as_nobody else ["-m", "hmaclient.cli"]), *args]
    env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "LANG": "C.UTF-8"}
    r = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)


@pytest.fixture
def shared_dir():
    """A directory under /tmp every user may search (pytest's tmp_path is root's alone)."""
    d = tempfile.mkdtemp(prefix="hmad-tenancy-", dir="/tmp")
    os.chmod(d, 0o755)
    yield Path(d)
    shutil.rmtree(d, ignore_errors=True)


@pytest.mark.skipif(os.geteuid() != 0, reason="a client of another uid needs root to start it")
def test_daemon_never_reveals_one_users_prefix_to_another(shared_dir):
    """root sends a prompt, then nobody sends the same one: nobody's reports 0 cached tokens (it cannot tell
    that root sent it) and gets the same tokens. Each user's second request reuses its own first's."""
    model = make_tiny_gguf(shared_dir / "tiny.gguf", seed=5, types=MIXED)
    (shared_dir / "run").mkdir(mode=0o755)
    os.chmod(shared_dir / "run", 0o755)
    d = Daemon(model, shared_dir, "socket.mode=0666").wait_ready()
    try:
        got = [query(d.socket, who) for who in (False, True, True, False)]
    finally:
        assert d.stop() == 0, d.log_text()
    cached = [g["cached_tokens"] for g in got]
    assert cached[:2] == [0, 0] and cached[2] > 0 and cached[3] > 0, cached
    assert got[0]["prompt_tokens"] > 16  # at least one full block to share
    assert len({tuple(g["token_ids"]) for g in got}) == 1
