"""The one set of sampling limits, checked the same way by the HTTP front, the router's and the peers'
gRPC servicers and the engine.

`check_sampling` takes plain values so every front reads its own wire shape (OpenAI JSON, `SamplingParams`,
the engine's `Sampling`) and then applies the same rules. A violation raises `SamplingError` naming the
field; it is a plain exception (the engine imports this module and knows no gRPC) that the runtime maps to
INVALID_ARGUMENT with the error's `reason` and `field` (`xavier_core.runtime.domain_errors`).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

MAX_TEMPERATURE = 2.0  # OpenAI's range; 0 is greedy
# A top-k cut above a few thousand candidates samples the same tokens as no cut; 0 turns it off.
MAX_TOP_K = 10_000
MAX_TOKENS = 1 << 20  # an upper bound on any context; the router also checks prompt + max_tokens <= context
MAX_STOP_STRINGS = 16
MAX_STOP_STRING_CHARS = 256
MAX_STOP_TOKEN_IDS = 64
MAX_TOP_LOGPROBS = 20  # alternatives per token: OpenAI's chat limit, and vLLM's default cap
MAX_SEED = (1 << 64) - 1  # SamplingParams.seed is a uint64
MAX_CACHE_SALT_CHARS = 256
MAX_PENALTY = 2.0  # presence and frequency penalties: OpenAI's range [-2, 2]
MAX_REPETITION_PENALTY = 10.0  # above that every seen token is gone already; (0, 10], 1 is off
MAX_LOGIT_BIAS = 100.0  # OpenAI's range [-100, 100]
MAX_LOGIT_BIAS_TOKENS = 1024

SEED_STEP = 0x9E3779B97F4A7C15  # SplitMix64's increment: the seed state moves by this per sampled token

INVALID_SAMPLING = "INVALID_SAMPLING"
INVALID_MAX_TOKENS = "INVALID_MAX_TOKENS"
INVALID_CACHE_SALT = "INVALID_CACHE_SALT"


class SamplingError(ValueError):
    """A sampling value is out of range; `field` names it (e.g. "top_p") and `reason` is its ErrorInfo
    reason (INVALID_MAX_TOKENS for max_tokens, INVALID_CACHE_SALT for the salt, else INVALID_SAMPLING)."""

    def __init__(self, message: str, field: str, reason: str = INVALID_SAMPLING) -> None:
        super().__init__(message)
        self.field = field
        self.reason = reason


def check_sampling(
    *,
    max_tokens: int,
    temperature: float,
    top_p: float,
    top_k: int = 0,
    seed: int | None = None,
    stop: Sequence[str] = (),
    stop_token_ids: Sequence[int] = (),
    top_logprobs: int = 0,
    presence_penalty: float = 0.0,
    frequency_penalty: float = 0.0,
    repetition_penalty: float = 1.0,
    logit_bias: Mapping[int, float] | None = None,
    min_tokens: int = 0,
    min_p: float = 0.0,
) -> None:
    """Raises `SamplingError` for the first value outside the limits above (the token ids of
    `logit_bias` against the vocabulary are the caller's check: only it knows the model)."""
    if not 1 <= max_tokens <= MAX_TOKENS:
        raise SamplingError(
            f"max_tokens must be in [1, {MAX_TOKENS}], got {max_tokens}", "max_tokens", INVALID_MAX_TOKENS
        )
    if not (math.isfinite(temperature) and 0.0 <= temperature <= MAX_TEMPERATURE):
        raise SamplingError(
            f"temperature must be in [0, {MAX_TEMPERATURE}], got {temperature}", "temperature"
        )
    if not (math.isfinite(top_p) and 0.0 < top_p <= 1.0):
        raise SamplingError(f"top_p must be in (0, 1], got {top_p}", "top_p")
    if not 0 <= top_k <= MAX_TOP_K:
        raise SamplingError(f"top_k must be in [0, {MAX_TOP_K}] (0: off), got {top_k}", "top_k")
    if seed is not None and not 0 <= seed <= MAX_SEED:
        raise SamplingError(f"seed must be in [0, 2^64), got {seed}", "seed")
    if len(stop) > MAX_STOP_STRINGS or any(not s or len(s) > MAX_STOP_STRING_CHARS for s in stop):
        raise SamplingError(
            f"stop takes at most {MAX_STOP_STRINGS} non-empty strings of at most "
            f"{MAX_STOP_STRING_CHARS} characters",
            "stop",
        )
    if len(stop_token_ids) > MAX_STOP_TOKEN_IDS or any(t < 0 for t in stop_token_ids):
        raise SamplingError(
            f"stop_token_ids takes at most {MAX_STOP_TOKEN_IDS} non-negative ids", "stop_token_ids"
        )
    if not 0 <= top_logprobs <= MAX_TOP_LOGPROBS:
        raise SamplingError(
            f"top_logprobs must be in [0, {MAX_TOP_LOGPROBS}], got {top_logprobs}", "top_logprobs"
        )
    _check_controls(
        max_tokens,
        presence_penalty,
        frequency_penalty,
        repetition_penalty,
        logit_bias or {},
        min_tokens,
        min_p,
    )


def _check_controls(
    max_tokens: int,
    presence: float,
    frequency: float,
    repetition: float,
    logit_bias: Mapping[int, float],
    min_tokens: int,
    min_p: float,
) -> None:
    for name, value in (("presence_penalty", presence), ("frequency_penalty", frequency)):
        if not (math.isfinite(value) and -MAX_PENALTY <= value <= MAX_PENALTY):
            raise SamplingError(f"{name} must be in [-{MAX_PENALTY:g}, {MAX_PENALTY:g}], got {value}", name)
    if not (math.isfinite(repetition) and 0.0 < repetition <= MAX_REPETITION_PENALTY):
        raise SamplingError(
            f"repetition_penalty must be in (0, {MAX_REPETITION_PENALTY:g}], got {repetition}",
            "repetition_penalty",
        )
    if len(logit_bias) > MAX_LOGIT_BIAS_TOKENS or any(
        t < 0 or not (math.isfinite(b) and -MAX_LOGIT_BIAS <= b <= MAX_LOGIT_BIAS)
        for t, b in logit_bias.items()
    ):
        raise SamplingError(
            f"logit_bias takes at most {MAX_LOGIT_BIAS_TOKENS} token ids, each with a bias in "
            f"[-{MAX_LOGIT_BIAS:g}, {MAX_LOGIT_BIAS:g}]",
            "logit_bias",
        )
    if not 0 <= min_tokens <= max_tokens:
        raise SamplingError(
            f"min_tokens must be in [0, max_tokens={max_tokens}], got {min_tokens}", "min_tokens"
        )
    if not (math.isfinite(min_p) and 0.0 <= min_p <= 1.0):
        raise SamplingError(f"min_p must be in [0, 1], got {min_p}", "min_p")


def check_cache_salt(salt: str) -> None:
    """Raises `SamplingError` when the prefix-cache salt is longer than `MAX_CACHE_SALT_CHARS`."""
    if len(salt) > MAX_CACHE_SALT_CHARS:
        raise SamplingError(
            f"cache_salt is longer than {MAX_CACHE_SALT_CHARS} characters", "cache_salt", INVALID_CACHE_SALT
        )


def advance_seed(seed: int, steps: int) -> int:
    """The seed of a request that starts `steps` sampled tokens into a run seeded with `seed`: its
    token i draws what the original run's token `steps + i` drew (a migrated request continues the
    same random stream; see `step_seed`)."""
    return (seed + steps * SEED_STEP) % (1 << 64)


def step_seed(seed: int, index: int) -> int:
    """The seed of the draw that samples output token `index` (0: the first) of a request seeded with
    `seed`: SplitMix64's `index`-th output, so every token's randomness depends only on the seed and its
    position, whichever engine (prefill, decode, a migration's new pair) samples it."""
    z = advance_seed(seed, index + 1)
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) % (1 << 64)
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) % (1 << 64)
    return z ^ (z >> 31)
