"""The salt field the SGLang-hosting services choose for the installed release (`sglang_host.salt`) is one
that release's own classes isolate by: the `/generate` body parses as its `GenerateReqInput` with the salt
in that field, a real `RadixCache` keyed by it never serves one salt's prefix to another, and HiCache's
storage keys are refused exactly where the release's own chain ignores the salt."""

from __future__ import annotations

import inspect
from typing import Any

import pytest

pytest.importorskip("sglang.srt.mem_cache.radix_cache", reason="the real sglang package is not installed")

import sglang
import torch
from sglang.srt.managers.io_struct import GenerateReqInput
from sglang.srt.managers.schedule_batch import Req
from sglang.srt.mem_cache.radix_cache import RadixCache, RadixKey
from xavier.v1 import types_pb2
from xavier_services.sglang_host.protocol import generate_body
from xavier_services.sglang_host.salt import SaltField, salt_support

pytestmark = pytest.mark.sglang

PAGE = 4
TOKENS = list(range(100, 100 + 4 * PAGE))


def _field() -> SaltField:
    field = salt_support(sglang.__version__, storage=False).field
    assert field is not None, f"no salt field for SGLang {sglang.__version__}"
    return field


def _matched(cache: Any, key: Any) -> int:
    from sglang.srt.mem_cache.base_prefix_cache import MatchPrefixParams

    got = cache.match_prefix(MatchPrefixParams(key=key))
    return int(got.device_prefix_len) if hasattr(got, "device_prefix_len") else len(got.device_indices)


def test_the_body_parses_with_the_salt_in_the_chosen_field() -> None:
    field = _field()
    body = generate_body("r1", TOKENS, types_pb2.SamplingParams(max_tokens=4))
    salt_support(sglang.__version__, storage=False).apply(body, "tenant-a")
    obj = GenerateReqInput(**body)  # a field this release does not know raises TypeError
    obj.normalize_batch_and_arguments()
    assert getattr(obj, field.value) == "tenant-a"
    # The scheduler's request takes the same field (and the radix cache reads it from there).
    assert field.value in inspect.signature(Req.__init__).parameters


def test_a_radix_cache_keyed_by_the_field_keeps_salts_apart() -> None:
    field = _field()
    cache = RadixCache.create_simulated(page_size=PAGE)
    from sglang.srt.mem_cache.base_prefix_cache import InsertParams

    def key(salt: str | None) -> Any:
        return RadixKey(TOKENS, **{field.value: salt})

    cache.insert(InsertParams(key=key("tenant-a"), value=torch.arange(len(TOKENS), dtype=torch.int64)))
    assert _matched(cache, key("tenant-a")) == len(TOKENS)
    assert _matched(cache, key("tenant-b")) == 0
    assert _matched(cache, key(None)) == 0


def test_hicache_storage_is_refused_exactly_where_the_chain_ignores_the_salt() -> None:
    from sglang.srt.mem_cache import utils

    support = salt_support(sglang.__version__, storage=True)
    field = _field()
    if hasattr(utils, "get_storage_hash_str"):  # 0.5.23: the chain is seeded by the request namespace
        chains = [utils.get_storage_hash_str(RadixKey(TOKENS, **{field.value: s}), None, PAGE) for s in "ab"]
    else:  # 0.5.17: `compute_node_hash_values` hashes a root child's key with no seed
        chains = [utils.get_hash_str(RadixKey(TOKENS, **{field.value: s}), None, PAGE) for s in "ab"]
    salted_chain = chains[0] != chains[1]
    assert (support.field is not None) == salted_chain, (sglang.__version__, support)
