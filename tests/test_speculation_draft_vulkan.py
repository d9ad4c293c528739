"""A draft model on the Vulkan backend (lavapipe in CI): the target and the draft each on a backend of
their own on the same device (their own KV pools and recordings), greedy answers identical with and
without the draft in deterministic mode, drafts kept and rolled back, every block of both caches given
back (tests/test_speculation_draft.py has the rest, on numpy)."""

from __future__ import annotations

import dataclasses

import pytest
from test_speculation import GREEDY, prompts, requests
from test_speculation_draft import wayward, with_draft
from tiny_gguf import MIXED, make_tiny_gguf
from vk_harness import require_vulkan

from hmad.composition import load_draft, load_model

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    require_vulkan()
    d = tmp_path_factory.mktemp("vkdraft")
    target = load_model(make_tiny_gguf(d / "tiny.gguf", seed=7, types=MIXED), "vulkan", deterministic=True)
    draft = load_draft(wayward(d / "wayward.gguf"), target, deterministic=True)
    yield target, draft
    draft.backend.close()
    target.backend.close()


def test_greedy_identical_with_a_draft_model(models):
    target, draft = models
    assert draft.backend is not target.backend and draft.backend.name == "vulkan"
    assert draft.backend.device == target.backend.device
    params = dataclasses.replace(GREEDY, max_tokens=10)
    off, on, st = with_draft(target, draft, lambda: requests(prompts(2), params), max_seqs=2)
    assert on == off
    assert st["accepted"] > 0 and st["rolled_back"] > 0, st
    assert st["draft"]["memory"], st["draft"]
