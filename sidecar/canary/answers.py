"""What the canary takes from a server's answer, checked field by field.

The canary exists for servers that may be broken, so it never trusts their answers: a top
logprob ``"abc"``, ``NaN``, ``1e400``, a list where an object belongs, a missing usage
block or ten thousand positions are each a :class:`RequestFailed` with reason
``protocol`` (a counted probe error), never a traceback and never a number that would
poison the comparison (a ``NaN`` divergence compares as "not over tolerance": blind).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from sidecar.canary.endpoint import CanaryError

MAX_POSITIONS = 4096  # generated positions in one answer (the canary asks for a few)
MAX_TOP = 1024  # candidates per position
MAX_TOKEN_CHARS = 1024
LOGPROB_RANGE = (-1e5, 1e-3)  # vLLM writes -inf as -9999.0; a logprob is never > 0
MAX_COUNT = 2**31  # prompt / cached tokens


class RequestFailed(CanaryError):
    """One request failed; ``reason`` is the ``reason`` label of the errors counter
    (connect, http, protocol, timeout)."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason


@dataclass
class Completion:
    """One answer: generated tokens, the top-k logprobs per position and reported usage."""

    tokens: list[str]
    top_logprobs: list[dict[str, float]]
    prompt_tokens: int
    cached_tokens: int | None  # None: the server does not report it
    latency_s: float
    raw_usage: dict[str, Any] = field(default_factory=dict)


def _bad(what: str) -> RequestFailed:
    return RequestFailed("protocol", f"malformed answer from the server: {what}")


def _token(v: Any, where: str) -> str:
    if not isinstance(v, str) or len(v) > MAX_TOKEN_CHARS:
        raise _bad(f"{where} is not a token string")
    return v


def _logprob(v: Any, where: str) -> float:
    lo, hi = LOGPROB_RANGE
    if not isinstance(v, int | float) or isinstance(v, bool) or not math.isfinite(v) \
            or not lo <= v <= hi:
        raise _bad(f"{where} is {str(v)[:40]!r}, not a logprob (a number in [{lo:g}, 0])")
    return float(v)


def _first_choice(body: Any, api: str) -> dict[str, Any]:
    choices = body.get("choices") if isinstance(body, dict) else None
    if not isinstance(choices, list) or not choices or not isinstance(choices[0], dict):
        raise RequestFailed("protocol", "the server's answer has no choices: not an "
                            f"OpenAI-compatible {api} response")
    return choices[0]


def parse_completion(body: Any, latency_s: float) -> Completion:
    """Tokens, logprobs and usage out of a ``/v1/completions`` response."""
    choice = _first_choice(body, "/v1/completions")
    lp = choice.get("logprobs")
    if not isinstance(lp, dict) or not lp.get("top_logprobs"):
        raise RequestFailed("protocol", "the server returned no logprobs: the canary needs "
                            "a server that supports `logprobs` on /v1/completions")
    raw_tokens, raw_tops = lp.get("tokens") or [], lp["top_logprobs"]
    if not isinstance(raw_tokens, list) or not isinstance(raw_tops, list) \
            or len(raw_tokens) > MAX_POSITIONS or len(raw_tops) > MAX_POSITIONS:
        raise _bad(f"logprobs.tokens/top_logprobs are not lists of at most {MAX_POSITIONS}")
    tokens = [_token(t, f"logprobs.tokens[{i}]") for i, t in enumerate(raw_tokens)]
    tops: list[dict[str, float]] = []
    for i, pos in enumerate(raw_tops):
        if not isinstance(pos, dict) or len(pos) > MAX_TOP:
            raise _bad(f"top_logprobs[{i}] is not an object of at most {MAX_TOP} tokens")
        tops.append({_token(k, f"top_logprobs[{i}] key"): _logprob(v, f"top_logprobs[{i}]"
                                                                      f"[{str(k)[:20]!r}]")
                     for k, v in pos.items()})
    return _with_usage(body, tokens, tops, latency_s)


def parse_chat(body: Any, latency_s: float) -> Completion:
    """The same from a ``/v1/chat/completions`` response (``logprobs.content``)."""
    choice = _first_choice(body, "/v1/chat/completions")
    lp = choice.get("logprobs")
    content = lp.get("content") if isinstance(lp, dict) else None
    if not isinstance(content, list) or not content:
        raise RequestFailed("protocol", "the server returned no logprobs for a chat "
                            "completion: it does not support `logprobs`/`top_logprobs`")
    if len(content) > MAX_POSITIONS:
        raise _bad(f"logprobs.content has more than {MAX_POSITIONS} positions")
    tokens: list[str] = []
    tops: list[dict[str, float]] = []
    for i, pos in enumerate(content):
        if not isinstance(pos, dict):
            raise _bad(f"logprobs.content[{i}] is not an object")
        tokens.append(_token(pos.get("token"), f"logprobs.content[{i}].token"))
        cands = pos.get("top_logprobs") or []
        if not isinstance(cands, list) or len(cands) > MAX_TOP:
            raise _bad(f"logprobs.content[{i}].top_logprobs is not a list")
        top: dict[str, float] = {}
        for j, t in enumerate(cands):
            where = f"logprobs.content[{i}].top_logprobs[{j}]"
            if not isinstance(t, dict):
                raise _bad(f"{where} is not an object")
            top[_token(t.get("token"), f"{where}.token")] = _logprob(t.get("logprob"),
                                                                     f"{where}.logprob")
        tops.append(top)
    return _with_usage(body, tokens, tops, latency_s)


def _count(v: Any, where: str) -> int:
    if not isinstance(v, int) or isinstance(v, bool) or not 0 <= v < MAX_COUNT:
        raise _bad(f"{where} is {str(v)[:40]!r}, not a token count")
    return v


def _with_usage(body: dict[str, Any], tokens: list[str], tops: list[dict[str, float]],
                latency_s: float) -> Completion:
    usage = body.get("usage")
    if usage is None:
        usage = {}
    if not isinstance(usage, dict):
        raise _bad("usage is not an object")
    prompt = usage.get("prompt_tokens")
    details = usage.get("prompt_tokens_details")
    if details is not None and not isinstance(details, dict):
        raise _bad("usage.prompt_tokens_details is not an object")
    cached = (details or {}).get("cached_tokens")
    return Completion(tokens, tops,
                      0 if prompt is None else _count(prompt, "usage.prompt_tokens"),
                      None if cached is None else _count(
                          cached, "usage.prompt_tokens_details.cached_tokens"),
                      latency_s, dict(usage))


def model_id(body: Any, where: str) -> str:
    """The first model of a ``/models`` answer."""
    data = body.get("data") if isinstance(body, dict) else None
    first = data[0] if isinstance(data, list) and data else None
    mid = first.get("id") if isinstance(first, dict) else None
    if not isinstance(mid, str) or not mid or len(mid) > 512:
        raise RequestFailed("protocol", f"{where} lists no model: pass --model")
    return mid
