"""`build_batch`'s slot math against a per-token reference: each new token's slot, the decode rows' key
slots (zeros past a row's length, even where the row holds more pages) and masks, prefill segments."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import torch

from xavier_core.engine.runner import build_batch
from xavier_core.engine.scheduler import StepPlan

PAGE = 4


def _req(length: int, computed: int, pages: list[int]) -> Any:
    return SimpleNamespace(tokens=list(range(100, 100 + length)), num_computed=computed, pages=pages)


def _slot(pages: list[int], position: int) -> int:
    return pages[position // PAGE] * PAGE + position % PAGE


def test_decode_rows_and_prefill_segments_get_the_slots_of_their_pages() -> None:
    decode_a = _req(6, 5, [9, 3, 7])  # one page more than its 6 keys need
    decode_b = _req(67, 66, [40 + i for i in range(17)] + [2])  # width pads to 128
    prefill = _req(7, 2, [11, 5])
    plan: Any = StepPlan([(decode_a, 1), (decode_b, 1), (prefill, 5)])
    batch = build_batch(plan, PAGE, torch.device("cpu"), [])

    expected_out = [_slot(decode_a.pages, 5), _slot(decode_b.pages, 66)]
    expected_out += [_slot(prefill.pages, p) for p in range(2, 7)]
    assert batch.out_slots.tolist() == expected_out
    assert batch.input_ids.tolist() == [105, 166, 102, 103, 104, 105, 106]
    assert batch.positions.tolist() == [5, 66, 2, 3, 4, 5, 6]
    assert batch.sample_idx.tolist() == [0, 1, 6]
    assert batch.num_decode == 2

    assert batch.decode_slots is not None and batch.decode_mask is not None
    assert batch.decode_slots.shape == (2, 128) and batch.decode_slots.dtype == torch.long
    for row, (req, length) in enumerate(((decode_a, 6), (decode_b, 67))):
        want = [_slot(req.pages, j) for j in range(length)] + [0] * (128 - length)
        assert batch.decode_slots[row].tolist() == want
        assert batch.decode_mask[row, 0, 0].tolist() == [j < length for j in range(128)]

    (segment,) = batch.segments
    assert (segment.start, segment.length, segment.prefix_len) == (2, 5, 2)
    assert segment.kv_slots.tolist() == [_slot(prefill.pages, p) for p in range(7)]


def test_a_prefill_only_step_has_no_decode_table() -> None:
    plan: Any = StepPlan([(_req(9, 0, [1, 0, 4]), 9)])
    batch = build_batch(plan, PAGE, torch.device("cpu"), [])
    assert batch.decode_slots is None and batch.decode_mask is None
    assert batch.out_slots.tolist() == [_slot([1, 0, 4], p) for p in range(9)]
