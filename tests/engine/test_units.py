"""Page allocator, prefix cache, stop strings and incremental detokenization in isolation."""

from __future__ import annotations

from pathlib import Path

import pytest

from xavier_core.engine.api import OutOfPagesError
from xavier_core.engine.page_allocator import PageAllocator
from xavier_core.engine.prefix_cache import PrefixCache
from xavier_core.prefix_keys import chain_seed, page_keys
from xavier_core.text.tokenizer import IncrementalDetokenizer, StopMatcher, TextTokenizer


def test_allocator_refcounts_and_pins() -> None:
    alloc = PageAllocator(4)
    pages = alloc.allocate(3)
    assert alloc.num_free == 1
    with pytest.raises(OutOfPagesError):
        alloc.allocate(2)
    alloc.retain(pages[:1])
    assert alloc.release(pages) == pages[1:]
    alloc.free(pages[1:])
    alloc.pin("req", pages[:1])
    assert alloc.num_pinned == 1 and alloc.is_pinned("req")
    assert alloc.release(alloc.unpin("req")) == pages[:1]
    assert alloc.unpin("req") == []
    with pytest.raises(RuntimeError):
        alloc.release(pages[:1])


def test_prefix_cache_match_confirms_tokens_and_evicts_lru() -> None:
    cache = PrefixCache(PageAllocator(4), page_size=2)
    seed = chain_seed("layout", "")
    tokens = [1, 2, 3, 4, 5]
    keys = page_keys(seed, tokens, 2)
    pages = cache.allocate(3)
    for i, key in enumerate(keys):
        cache.insert(key, pages[i], tokens[2 * i : 2 * i + 2])
    cache.release(pages)
    assert cache.num_evictable == 2 and cache.allocator.num_free == 2
    hit = cache.match(keys, tokens, max_pages=2)
    assert hit == pages[:2] and cache.num_evictable == 0
    cache.release(hit)
    # Same keys but different tokens (a forged collision) never match.
    assert cache.match(keys, [9, 9, 3, 4], max_pages=2) == []
    # Another salt gives other keys.
    assert cache.match(page_keys(chain_seed("layout", "b"), tokens, 2), tokens, 2) == []
    got = cache.allocate(3)  # 2 free + the LRU page (the first one: released first)
    assert cache.evictions == 1 and pages[0] in got
    assert cache.match(keys, tokens, 2) == []  # its chain is broken at page 0
    with pytest.raises(OutOfPagesError):
        cache.allocate(2)


def test_stop_matcher_holds_back_partial_stops() -> None:
    m = StopMatcher(["END", "xy"])
    assert m.feed("abc E") == ("abc ", False)
    assert m.feed("N") == ("", False)
    assert m.feed("Dzz") == ("", True)
    m = StopMatcher(["END"])
    assert m.feed("E") == ("", False)
    assert m.feed("x") == ("Ex", False)
    assert m.feed("EN") == ("", False)
    assert m.flush() == "EN"


def test_incremental_detokenizer_never_splits_characters(tiny_dirs: dict[str, Path]) -> None:
    tok = TextTokenizer.load(tiny_dirs["llama"])
    text = "café 🙂 naïve — “done”" * 6
    ids = tok.encode(text, add_special_tokens=False)
    detok = IncrementalDetokenizer(tok, tok.encode("prefix ", add_special_tokens=False))
    deltas = [detok.push(t) for t in ids]
    assert "".join(deltas) == text
    assert not any("\ufffd" in d for d in deltas)
    assert "" in deltas  # the emoji spans several byte-level tokens
