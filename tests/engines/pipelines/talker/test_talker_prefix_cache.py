"""The talker's prompt-prefix cache (engines/models/prefix_cache.py) against the official codes.

Greedy codes with the cache on must be identical to the official ``generate()``'s (oracle
fixtures) and to the cache off, for every release type: CustomVoice (talker fixtures),
Base in-context and x-vector cloning, VoiceDesign and 1.7B-style instructions (clone
fixtures), and live text. Each case runs twice, one request at a time, so the second run
and every later case sharing a prefix (speaker, instructions, saved voice) read cached K/V;
the tests assert that they did (hits and positions served), so a cache that never hits
fails. Eviction (budget and pool pressure) and owner isolation are checked on the random
in-process talker (testsupport/talker.py) against the cache off.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from engines.contract import SynthesisRequest, TextFeed
from engines.pipelines.talker.live_text import LiveText
from engines.pipelines.talker.source import TalkerSource
from tests.oracle import clone_fixtures as cfx
from tests.oracle import talker_fixtures as tfx
from testsupport.talker import make_bundle, step

pytestmark = pytest.mark.parity


def run_one(source: TalkerSource, request: SynthesisRequest, **admit) -> torch.Tensor:
    source.admit(request, **admit)
    frames = []
    while source.active_slots:
        frames += [f.codes for f in step(source) if f.request_id == request.id]
    return torch.cat(frames)


def run_twice(source: TalkerSource, requests: list[tuple[SynthesisRequest, dict]]) -> dict[str, list[torch.Tensor]]:
    out: dict[str, list[torch.Tensor]] = {}
    for again in range(2):
        for request, admit in requests:
            out.setdefault(request.id, []).append(run_one(source, replace(request, id=f"{request.id}#{again}"), **admit))
    return out


def assert_served_from_cache(source: TalkerSource, requests: int) -> None:
    stats = source.kv_cache_stats()
    # every repeat at least hits (its whole prompt but the last position is indexed)
    assert stats["prefix_hits"] >= requests, stats
    assert stats["prefix_hit_positions"] > 0, stats


@pytest.mark.parametrize("name", tfx.CHECKPOINTS)
def test_custom_voice_codes_equal_official_with_the_cache(name):
    from engines.pipelines.talker.reference import TalkerBundle

    bundle = TalkerBundle.from_checkpoint(tfx.checkpoint_dir(name))
    refs = tfx.references(name)
    requests = [(SynthesisRequest(id=case, text=c["prompt"], voice=c["speaker"], language=c["language"], greedy=True,
                                  instructions=c["instruct"], max_new_tokens=c["max_new_tokens"]),
                 {"non_streaming_mode": c["non_streaming_mode"]}) for case, c in tfx.cases(name).items()]
    source = TalkerSource.from_bundle(bundle, max_slots=2, max_seq_len=256, block_size=4)
    got = run_twice(source, requests)
    for case in tfx.cases(name):
        for run in got[case]:
            assert torch.equal(run, refs[f"case/{case}/codes"]), (name, case)
    assert_served_from_cache(source, len(requests))


def test_clone_design_and_instruct_codes_equal_official_with_the_cache():
    """Base (in-context and x-vector cloning, both text modes), VoiceDesign and 1.7B-style
    CustomVoice with instructions; the saved voice's owner is set, as the service sets it."""
    from engines.pipelines.talker.reference import TalkerBundle

    for name in ("base", "design", "cv17"):
        bundle, refs = TalkerBundle.from_checkpoint(cfx.checkpoint_dir(name)), cfx.references(name)
        requests = []
        for case, c in cfx.info(name)["cases"].items():
            clone = None
            if c["kind"] == "clone":
                clone = bundle.clone_voice(refs[f"ref/{c['ref']}/wav"].numpy(), c["ref_text"], c["x_vector_only_mode"])
            requests.append((SynthesisRequest(id=case, text=c["text"], voice=c["speaker"] or "default",
                                              language=c["language"], greedy=True, instructions=c["instruct"],
                                              clone=clone, prefix_owner="key-a"),
                             {"non_streaming_mode": c["non_streaming_mode"]}))
        for block_size in (4, 16):  # partial-block copies and whole shared blocks
            source = TalkerSource.from_bundle(bundle, max_slots=2, max_seq_len=512, block_size=block_size)
            got = run_twice(source, requests)
            for request, _ in requests:
                for run in got[request.id]:
                    assert torch.equal(run, refs[f"case/{request.id}/codes"]), (name, request.id, block_size)
            assert_served_from_cache(source, len(requests))


def test_live_text_codes_equal_official_with_a_warm_cache():
    """A live utterance (text still arriving) admitted over a cache warmed by the same speaker."""
    from engines.pipelines.talker.reference import TalkerBundle

    name = tfx.CHECKPOINTS[0]
    bundle, refs = TalkerBundle.from_checkpoint(tfx.checkpoint_dir(name)), tfx.references(name)
    cases = {k: c for k, c in tfx.cases(name).items() if not c["non_streaming_mode"] and not c["instruct"]}
    source = TalkerSource.from_bundle(bundle, max_slots=2, max_seq_len=256, block_size=4)
    for again in range(2):
        for case, c in cases.items():
            feed = TextFeed()
            request = SynthesisRequest(id=f"{case}#{again}", text="", voice=c["speaker"], language=c["language"],
                                       greedy=True, text_feed=feed)
            live = LiveText(feed, bundle.prompt)
            words = c["prompt"].split(" ")
            feed.append(words[0])
            live.pull()
            while not live.ready:  # the first text id commits once the next word starts
                words = words[1:]
                feed.append(" " + words[0]) if words else feed.finish()
                live.pull()
            source.admit(request, live=live)
            frames, rest = [], [" " + w for w in words[1:]]
            while source.active_slots:
                if rest:
                    feed.append(rest.pop(0))
                elif not feed.finished:
                    feed.finish()
                frames += [f.codes for f in step(source)]
            assert torch.equal(torch.cat(frames), refs[f"case/{case}/codes"]), (case, again)
    assert source.kv_cache_stats()["prefix_hits"] >= len(cases)


# --------------------------------------------------------------------------- random talker: eviction, owners


def _requests(texts, voice="Ryan", **kw):
    return [SynthesisRequest(id=f"r{i}", text=t, voice=voice, greedy=True, max_new_tokens=12, **kw)
            for i, t in enumerate(texts)]


TEXTS = ["Hello world, this is a small test of streaming speech.", "the quick brown fox jumps over the lazy dog",
         "Hello world, this is a small test.", "你好，世界。数字 2026 and 42.", "the quick brown fox"]


def _codes(source, requests):
    return [run_one(source, r) for r in requests]


def test_eviction_under_a_small_budget_keeps_outputs_identical():
    bundle = make_bundle(seed=3, max_new_tokens=12)
    reqs = _requests(TEXTS * 2)
    off = _codes(TalkerSource.from_bundle(bundle, max_slots=1, max_seq_len=128, block_size=4,
                                          prefix_cache_fraction=0), reqs)
    # 63 blocks, 4 of them for the index: it must evict to index each new prompt.
    small = TalkerSource.from_bundle(bundle, max_slots=1, max_seq_len=128, block_size=4, kv_blocks=64,
                                     prefix_cache_fraction=4 / 63)
    on = _codes(small, reqs)
    assert all(torch.equal(a, b) for a, b in zip(off, on))
    stats = small.kv_cache_stats()
    assert stats["prefix_evictions"] > 0 and stats["prefix_blocks"] <= 4, stats
    assert stats["prefix_hits"] > 0, stats


def test_pool_pressure_takes_back_blocks_only_the_index_holds():
    """A pool the index has filled: the next prompt's blocks come from evicting unused entries."""
    bundle = make_bundle(seed=3, max_new_tokens=6)
    reqs = _requests(TEXTS)
    off = _codes(TalkerSource.from_bundle(bundle, max_slots=1, max_seq_len=64, block_size=4,
                                          prefix_cache_fraction=0), reqs)
    source = TalkerSource.from_bundle(bundle, max_slots=1, max_seq_len=64, block_size=4, kv_blocks=12,
                                      prefix_cache_fraction=1.0)
    on = _codes(source, reqs)
    assert all(torch.equal(a, b) for a, b in zip(off, on))
    stats = source.kv_cache_stats()
    assert stats["prefix_evictions"] > 0, stats
    # between requests nothing is in use: every block is free or evictable
    assert stats["blocks_used"] == 0 and source.cache.free_blocks == source.cache.capacity_blocks, stats


def test_shared_blocks_are_never_written_by_a_reader():
    """Copy-on-write: the K/V of indexed full blocks is bit-identical after a request that
    shared them ran to its end."""
    bundle = make_bundle(seed=5, max_new_tokens=10)
    source = TalkerSource.from_bundle(bundle, max_slots=1, max_seq_len=128, block_size=4)
    first, second = _requests([TEXTS[0], TEXTS[2]])
    run_one(source, first)
    indexed = list(source.prefix._lru)
    snapshot = [(k[b * 4:b * 4 + 4].clone(), v[b * 4:b * 4 + 4].clone()) for b in indexed
                for k, v in zip(source.cache.k, source.cache.v)]
    hits = source.kv_cache_stats()["prefix_hits"]
    run_one(source, second)
    assert source.kv_cache_stats()["prefix_hits"] == hits + 1
    after = [(k[b * 4:b * 4 + 4], v[b * 4:b * 4 + 4]) for b in indexed for k, v in zip(source.cache.k, source.cache.v)]
    assert all(torch.equal(a[0], b[0]) and torch.equal(a[1], b[1]) for a, b in zip(snapshot, after))


def test_owners_never_share_a_saved_voice():
    """A cloned voice's prefix is served only to its owner; without an owner it is not cached."""
    from engines.pipelines.talker.reference import TalkerBundle

    bundle, refs = TalkerBundle.from_checkpoint(cfx.checkpoint_dir("base")), cfx.references("base")
    c = cfx.info("base")["cases"]["icl_a_stream"]
    clone = bundle.clone_voice(refs["ref/a/wav"].numpy(), c["ref_text"], False)
    source = TalkerSource.from_bundle(bundle, max_slots=1, max_seq_len=512, block_size=4)

    def ask(i, owner, tenant=""):
        request = SynthesisRequest(id=f"q{i}", text=c["text"], language=c["language"], greedy=True, clone=clone,
                                   prefix_owner=owner, tenant=tenant)
        before = dict(source.kv_cache_stats())
        codes = run_one(source, request)
        assert torch.equal(codes, refs["case/icl_a_stream/codes"])
        after = source.kv_cache_stats()
        return after.get("prefix_hits", 0) - before.get("prefix_hits", 0), after.get("prefix_misses", 0) - before.get(
            "prefix_misses", 0)

    assert ask(0, "key-a") == (0, 1)  # cold
    assert ask(1, "key-b") == (0, 1)  # another owner: nothing of key-a's
    assert ask(2, "key-a") == (1, 0)  # the owner again: served from the cache
    assert ask(3, None, tenant="key-b") == (1, 0)  # the tenant is the owner when none is given
    assert ask(4, None) == (0, 0) and ask(5, "") == (0, 0)  # no owner: a clone is not even looked up
