"""Markdown for the bench's reports (bench/report.py and each scenario's own section): numbers, error
counts, tables."""

from __future__ import annotations

import math
from typing import Any


def num(value: Any, digits: int = 1, suffix: str = "") -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "-"
    return f"{value:.{digits}f}{suffix}"


def get(d: dict[str, Any] | None, *path: str) -> Any:
    for key in path:
        if not isinstance(d, dict):
            return None
        d = d.get(key)
    return d


def errors(e: dict[str, int] | None) -> str:
    return ", ".join(f"{k} x{v}" for k, v in sorted(e.items())) if e else "0"


def table(head: list[str], rows: list[list[str]]) -> list[str]:
    return [
        "| " + " | ".join(head) + " |",
        "|" + "|".join("---" for _ in head) + "|",
        *("| " + " | ".join(r) + " |" for r in rows),
    ]


def skipped(s: dict[str, Any]) -> list[str]:
    if "failed" in s:
        return [f"FAILED: {s['failed']}", ""]
    if "skipped" in s:
        return [f"Skipped: {s['skipped']}", ""]
    return []
