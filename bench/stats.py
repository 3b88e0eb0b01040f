"""The figures of the scenarios: percentiles, gaps against the model server's pace, lateness against
its schedule, and streams checked against the tokens they should have carried."""

from __future__ import annotations

import statistics
from collections import Counter
from typing import Any

from bench.clients import Stream


def pct(values: list[float], q: float) -> float:
    """The q-th percentile, nearest rank (NaN for no values)."""
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q / 100 * (len(ordered) - 1)))]


def dist(values: list[float], scale: float = 1.0) -> dict[str, float]:
    """p50, p99, max and count of `values` times `scale` (1000: seconds to milliseconds)."""
    if not values:
        return {"n": 0}
    return {
        "p50": scale * statistics.median(values),
        "p99": scale * pct(values, 99),
        "max": scale * max(values),
        "n": len(values),
    }


def gaps_minus_pace(s: Stream, tps: float) -> tuple[list[float], list[float]]:
    """(gaps, gap - pace) in seconds between consecutive text events of one stream."""
    gaps, late = [], []
    for i in range(1, len(s.times)):
        gap = s.times[i] - s.times[i - 1]
        gaps.append(gap)
        late.append(gap - (s.tokens[i] / tps if tps > 0 else 0.0))
    return gaps, late


def lateness(s: Stream, received_at: float, tps: float, ttft_s: float = 0.0) -> list[float]:
    """Each token's arrival minus the model server's schedule for it (seconds)."""
    out: list[float] = []
    k = 0
    interval = 1 / tps if tps > 0 else 0.0
    for t, n in zip(s.times, s.tokens, strict=True):
        for _ in range(n):
            out.append(t - (received_at + ttft_s + k * interval))
            k += 1
    return out


def user_text(body: dict[str, Any]) -> str:
    for message in reversed(body.get("messages") or []):
        if message.get("role") == "user":
            content = message.get("content")
            if isinstance(content, list):
                return "".join(str(p.get("text", "")) for p in content if isinstance(p, dict))
            return str(content or "")
    return ""


def check_tokens(streams: list[Stream], tokens: int) -> Counter[str]:
    errors: Counter[str] = Counter()
    for s in streams:
        if s.error is None and s.token_count != tokens:
            s.error = f"short:{s.token_count}/{tokens}"
        if s.error is not None:
            errors[s.error] += 1
    return errors


def error_detail(streams: list[Stream]) -> dict[str, dict[str, Any]]:
    """Per error code: how many, after how long (request -> error, p50/max seconds), how many of
    them had received text first, and the median tokens they received."""
    by: dict[str, list[Stream]] = {}
    for s in streams:
        if s.error is not None:
            by.setdefault(s.error, []).append(s)
    out: dict[str, dict[str, Any]] = {}
    for code, failed in by.items():
        ended = [s.end - s.start for s in failed if s.end]
        out[code] = {
            "count": len(failed),
            "after_s": dist(ended),
            "with_text": sum(1 for s in failed if s.first),
            "tokens_p50": statistics.median(s.token_count for s in failed),
        }
    return out


def paired(runs: dict[str, list[Stream]], target: str, base: str = "direct") -> list[tuple[Stream, Stream]]:
    """`target`'s streams beside `base`'s of the same rounds, both without error."""
    return [
        (t, d) for t, d in zip(runs[target], runs[base], strict=True) if t.error is None and d.error is None
    ]
