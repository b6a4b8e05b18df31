"""The engine's prompt check: the same answers for every kind of id sequence a caller hands it."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import pytest
from xavier.v1 import prefill_service_pb2

from xavier_core.engine.api import InvalidRequestError
from xavier_core.engine.request import check_prompt

VOCAB, CONTEXT = 1000, 64


def _as_field(ids: list[int]) -> Sequence[int]:
    return prefill_service_pb2.PrefillRequest(token_ids=ids).token_ids  # what a servicer hands over


@pytest.mark.parametrize("wrap", [list, tuple, _as_field, lambda ids: np.asarray(ids, dtype=np.int32)])
def test_good_ids_come_back_as_python_ints(wrap: object) -> None:
    ids = [0, 5, 999, 17]
    got = check_prompt(wrap(ids), VOCAB, CONTEXT)  # type: ignore[operator]
    assert got == ids
    assert all(type(t) is int for t in got)


@pytest.mark.parametrize(
    ("wrap", "ids", "named"),
    [
        (list, [3, -1, 1000, 7, *range(2000, 2010)], "[-1, 1000, 2000, 2001, 2002, 2003, 2004, 2005]"),
        (_as_field, [3, 1000, 7, *range(2000, 2010)], "[1000, 2000, 2001, 2002, 2003, 2004, 2005, 2006]"),
    ],
)
def test_ids_out_of_vocabulary_are_named_first_eight(wrap: object, ids: list[int], named: str) -> None:
    with pytest.raises(InvalidRequestError) as err:
        check_prompt(wrap(ids), VOCAB, CONTEXT)  # type: ignore[operator]
    assert str(err.value) == f"token ids out of vocabulary [0, 1000): {named}"


def test_ids_no_int64_holds_are_refused_not_crashed() -> None:
    with pytest.raises(InvalidRequestError, match=r"out of vocabulary .*\[1180591620717411303424\]"):
        check_prompt([1, 2**70], VOCAB, CONTEXT)


@pytest.mark.parametrize(
    ("ids", "message"), [([], "empty prompt"), ([1] * CONTEXT, "64 tokens; the context")]
)
def test_empty_and_too_long_prompts_are_refused(ids: list[int], message: str) -> None:
    with pytest.raises(InvalidRequestError, match=message):
        check_prompt(ids, VOCAB, CONTEXT)
    with pytest.raises(InvalidRequestError, match=message):
        check_prompt(_as_field(ids), VOCAB, CONTEXT)
