"""The SGLang P/D benchmark's in-run baseline: each round's figure over native's in the same round."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest


def _bench() -> ModuleType:
    path = Path(__file__).resolve().parents[1] / "benchmarks" / "sglang_pd.py"
    spec = importlib.util.spec_from_file_location("sglang_pd_bench", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _row(mode: str, tok_s: float, tpot: float, kind: str = "repeat", c: int = 32) -> dict[str, Any]:
    return {
        "mode": mode,
        "kind": kind,
        "concurrency": c,
        "out_tok_s": tok_s,
        "ttft_p50": 0.1,
        "tpot_p50": tpot,
    }


def test_ratios_pair_each_round_with_natives_and_take_the_median() -> None:
    bench = _bench()
    # Round 2 is slow for both modes: per-mode medians would mix it in, paired ratios cancel it.
    rows = [
        _row("native", 100.0, 0.004), _row("pd", 110.0, 0.005),
        _row("pd", 55.0, 0.009), _row("native", 50.0, 0.008),
        _row("native", 100.0, 0.004), _row("pd", 120.0, 0.003),
        {"mode": "pd", "round": 3, "failed": "boom"},  # a failed level pairs with nothing
    ]  # fmt: skip
    ratios = bench.paired_ratios([rows])
    level = ratios["pd"]["repeat/32"]
    assert level["pairs"] == 3
    assert level["out_tok_s"] == pytest.approx(1.1)  # of 1.1, 1.1, 1.2
    assert level["tpot_p50"] == pytest.approx(1.125)  # of 1.25, 1.125, 0.75 (medians: 0.005 / 0.004)
    assert level["ttft_p50"] == pytest.approx(1.0)
    assert "tpot_mean" not in level  # no row has it
    assert "native" not in ratios


def test_a_level_native_never_ran_has_no_ratio() -> None:
    bench = _bench()
    rows = [_row("pd", 100.0, 0.004, c=16), _row("native", 100.0, 0.004, c=32), _row("pd", 90.0, 0.004, c=32)]
    assert bench.paired_ratios([rows]) == {"pd": {"repeat/32": {"out_tok_s": 0.9, "ttft_p50": 1.0,
                                                              "tpot_p50": 1.0, "pairs": 1}}}  # fmt: skip


def test_rounds_pair_within_a_run_and_the_pairs_of_runs_pool() -> None:
    bench = _bench()
    one = [_row("native", 100.0, 0.004), _row("pd", 120.0, 0.004)]
    two = [_row("pd", 80.0, 0.004), _row("native", 100.0, 0.004), _row("pd", 90.0, 0.004)]
    level = bench.paired_ratios([one, two])["pd"]["repeat/32"]
    assert level["pairs"] == 2  # two's second pd run has no native to pair with
    assert level["out_tok_s"] == pytest.approx(1.0)  # of 1.2 and 0.8


def test_a_mode_may_name_its_router_processes_and_be_the_baseline() -> None:
    bench = _bench()
    assert bench.check_modes(["native@w1", "pd", "pd@w2", "direct-xavier"]) is None
    assert "unknown mode" in bench.check_modes(["pd", "turbo"])
    for bad in ("direct-native@w2", "pd@2", "pd@w0", "pd@wx"):
        assert "router-process count" in bench.check_modes([bad]), bad
    assert "twice" in bench.check_modes(["pd", "pd"])
    args = type("Args", (), {"router_workers": 2})()
    assert bench.router_workers("native@w1", args) == 1
    assert bench.router_workers("pd", args) == 2
    assert bench.mode_kind("native@w1") == "native"
    rows = [_row("native@w1", 100.0, 0.004), _row("pd", 130.0, 0.004), _row("native", 90.0, 0.004)]
    ratios = bench.paired_ratios([rows], "native@w1")
    assert ratios["pd"]["repeat/32"]["out_tok_s"] == pytest.approx(1.3)
    assert ratios["native"]["repeat/32"]["out_tok_s"] == pytest.approx(0.9)
    assert "native@w1" not in ratios
