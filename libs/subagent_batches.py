"""Seed 3's `SubagentBatch[]`, built from subagent_sessions rows: the same builder writes the anchor's
`metadata.subagents` and restores it when the metadata is missing, so both come out identical."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from agentmesh.v1 import events_pb2 as ev
from agentmesh.v1 import trace_pb2 as tp
from libs.protojson import enum_to_str

_STATUS = ev.SubagentStatus.DESCRIPTOR


def item_from_row(row: tp.SubagentSession) -> ev.SubagentItem:
    return ev.SubagentItem(
        id=row.id,
        name=row.name,
        source_type=row.source_type,
        status=row.status,
        goal=row.goal,
        summary=row.summary,
        error=row.error,
        token_usage=row.token_usage,
        sort_order=row.sort_order,
        session_id=row.child_session_id,
        model=row.model,
    )


def summarize(statuses: Iterable[int]) -> ev.SubagentSummary:
    s = ev.SubagentSummary()
    for status in statuses:
        s.total += 1
        if status == ev.SUBAGENT_STATUS_COMPLETED:
            s.completed += 1
        elif status in (ev.SUBAGENT_STATUS_QUEUED, ev.SUBAGENT_STATUS_RUNNING):
            s.running += 1
        else:
            s.failed += 1
    return s


def _item_json(row: tp.SubagentSession) -> dict[str, Any]:
    item: dict[str, Any] = {
        "id": row.id,
        "name": row.name,
        "sourceType": row.source_type,
        "status": enum_to_str(_STATUS, row.status),
        "goal": row.goal,
        "sortOrder": row.sort_order,
        "sessionId": row.child_session_id,
        "tokenUsage": {
            "inputTokens": row.token_usage.input_tokens,
            "outputTokens": row.token_usage.output_tokens,
        },
    }
    if row.summary:
        item["summary"] = row.summary
    if row.error:
        item["error"] = row.error
    return item


def build_batches(rows: Iterable[tp.SubagentSession]) -> list[dict[str, Any]]:
    """Rows of one anchor -> batches, one per delegate tool call, in creation order."""
    groups: dict[str, list[tp.SubagentSession]] = {}
    for row in sorted(rows, key=lambda r: r.id):
        groups.setdefault(row.parent_tool_call_id or f"row-{row.id}", []).append(row)
    batches = []
    for members in groups.values():
        members.sort(key=lambda r: (r.sort_order, r.id))
        s = summarize(r.status for r in members)
        batches.append(
            {
                "parentMessageId": members[0].parent_message_id,
                "title": members[0].batch_title,
                "toolCallId": members[0].parent_tool_call_id,
                "items": [_item_json(r) for r in members],
                "summary": {
                    "total": s.total,
                    "completed": s.completed,
                    "running": s.running,
                    "failed": s.failed,
                },
            }
        )
    return batches


def restore(messages: list[dict[str, Any]], rows: Iterable[tp.SubagentSession]) -> None:
    """Seed 3 section 11.1: an assistant message without `metadata.subagents` gets its batches
    rebuilt from the rows anchored to it (in place; messages are browser JSON dicts)."""
    by_anchor: dict[int, list[tp.SubagentSession]] = {}
    for row in rows:
        by_anchor.setdefault(row.parent_message_id, []).append(row)
    for message in messages:
        anchored = by_anchor.get(message.get("id", 0))
        if not anchored or message.get("role") != "assistant":
            continue
        metadata = message.setdefault("metadata", {})
        if not metadata.get("subagents"):
            metadata["subagents"] = build_batches(anchored)
