// Subagent batch cards
// (docs/requirements.md#subagent-cards): one card per delegate batch, inline in the assistant message whose
// id is the batch's parentMessageId. Live events and restored metadata.subagents build the same card.
// A subagent's summary and its live text are markdown, shown whole (a long one folds behind "Show
// all", never inside a scrolling box that cuts its code). Its live text comes from its buffer while
// that exists, then from its stored trace; "open" shows the whole trace in the side panel (an
// `open-trace` event that bubbles up to the page). The batch's badge says how it ended: done (all
// completed), cancelled, failed, or partly done.

import { api, json } from "./api.js";
import { h } from "./dom.js";
import { errorCode, errorText } from "./errors.js";
import { LiveMarkdown, renderMarkdown } from "./markdown.js";
import { follow, resumeHeaders } from "./sse.js";

const TERMINAL = new Set(["completed", "failed", "cancelled"]);

export class BatchCard {
  constructor({ toolCallId = "", title = "Subagents", total = 0 }) {
    this.toolCallId = toolCallId;
    this.total = total;
    this.items = new Map(); // subagent id -> SubagentRow
    this.summary = null; // set by done()
    this.state = h("span", { class: "badge batch-state", dataset: { status: "running" } }, "running");
    this.counts = h("span", { class: "batch-summary" });
    this.list = h("ol", { class: "batch-items" });
    this.el = h(
      "section",
      { class: "batch", dataset: { toolCallId } },
      h(
        "header",
        { class: "batch-head" },
        h("span", { class: "batch-icon", "aria-hidden": "true" }),
        h("span", { class: "batch-title" }, title),
        this.counts,
        this.state,
      ),
      this.list,
    );
    this.refresh();
  }

  /** A card from one entry of an assistant message's metadata.subagents. */
  static restore(batch) {
    const items = batch.items ?? [];
    const card = new BatchCard({ ...batch, total: batch.summary?.total ?? items.length });
    for (const item of items) card.update(item);
    if (batch.summary && !batch.summary.running) card.done(batch.summary);
    return card;
  }

  get finished() {
    return this.summary !== null;
  }

  has(id) {
    return this.items.has(id);
  }

  /** subagent-update: the item as it is now. */
  update(item) {
    let row = this.items.get(item.id);
    if (!row) {
      row = new SubagentRow(item, () => this.changed());
      this.items.set(item.id, row);
      const after = [...this.items.values()].find((r) => r !== row && r.sortOrder > row.sortOrder);
      this.list.insertBefore(row.el, after ? after.el : null);
    }
    row.set(item);
    this.refresh();
  }

  /** A background item ended after its turn (no subagent-done comes for it): the counts, and the
   * card's end once every item has ended. */
  changed() {
    const counts = this.liveCounts();
    if (!this.finished && !counts.running) this.done(counts);
    else this.refresh();
  }

  /** subagent-done: the final counts. */
  done(summary) {
    this.summary = summary;
    const state = batchState(summary);
    this.state.textContent = BATCH_LABEL[state];
    this.state.dataset.status = state;
    this.el.dataset.status = state;
    this.refresh();
  }

  refresh() {
    const s = this.summary ?? this.liveCounts();
    const parts = [`${s.completed}/${s.total} completed`];
    if (this.finished || s.failed) parts.push(`${s.failed} failed`);
    if (s.cancelled) parts.push(`${s.cancelled} cancelled`);
    if (!this.finished) parts.push(`${s.running} running`);
    this.counts.textContent = parts.join(" · ");
  }

  liveCounts() {
    const statuses = [...this.items.values()].map((r) => r.status);
    const count = (status) => statuses.filter((s) => s === status).length;
    const [completed, failed, cancelled] = [count("completed"), count("failed"), count("cancelled")];
    const total = Math.max(this.total, statuses.length);
    return { total, completed, failed, cancelled, running: total - completed - failed - cancelled };
  }
}

const BATCH_LABEL = { completed: "done", cancelled: "cancelled", failed: "failed", partial: "partly done" };

/** How a finished batch ended, from its counts. */
export function batchState({ total = 0, completed = 0, failed = 0, cancelled = 0 }) {
  if (completed >= total) return "completed";
  if (!completed && !failed) return "cancelled";
  if (!completed && !cancelled) return "failed";
  return "partial";
}

/** One subagent: name, status, goal, summary or error; a click shows its live text. */
class SubagentRow {
  constructor(item, onChange = () => {}) {
    this.onChange = onChange;
    this.watching = false;
    this.id = item.id;
    this.traceId = item.childTraceId ?? "";
    this.sortOrder = item.sortOrder ?? 0;
    this.status = "";
    this.name = h("span", { class: "sub-name" });
    this.badge = h("span", { class: "badge" });
    this.goal = h("div", { class: "sub-goal" });
    this.result = h("div", { class: "sub-result" });
    this.more = h("button", { type: "button", class: "link sub-more", hidden: true, "aria-expanded": "false", onclick: () => this.unfold() }, "Show all");
    this.resultText = null;
    this.liveBody = h("div", { class: "sub-live-text" });
    this.live = h("div", { class: "sub-live", hidden: true }, this.liveBody);
    this.liveText = new LiveMarkdown(this.liveBody);
    this.el = h(
      "li",
      { class: "sub", dataset: { subagentId: item.id } },
      h(
        "button",
        { type: "button", class: "sub-head", title: "Show its text", "aria-expanded": "false", onclick: () => this.toggle() },
        h("span", { class: "dot", "aria-hidden": "true" }),
        this.name,
        this.badge,
      ),
      h("button", { type: "button", class: "link open-trace", title: "Open the subagent's trace in the side panel", onclick: (e) => this.open(e.currentTarget) }, "open"),
      this.goal,
      this.result,
      this.more,
      this.live,
    );
  }

  /** The whole trace in the side panel, following it live while it runs. */
  open(opener = null) {
    const detail = { name: this.name.textContent, task: this.goal.textContent, traceId: this.traceId, streamUrl: this.streamUrl(), opener };
    this.el.dispatchEvent(new CustomEvent("open-trace", { bubbles: true, detail }));
  }

  streamUrl() {
    return `/api/subagents/${encodeURIComponent(this.id)}/stream`;
  }

  set(item) {
    this.item = item;
    this.status = item.status;
    this.traceId = item.childTraceId || this.traceId;
    this.sortOrder = item.sortOrder ?? this.sortOrder;
    this.el.dataset.status = item.status;
    this.name.textContent = item.name || `subagent ${item.id}`;
    this.badge.textContent = item.status;
    this.badge.dataset.status = item.status;
    this.goal.textContent = item.goal || "";
    this.setResult(item.error ? { error: item.error } : { summary: item.summary || "" });
    if (item.background && !TERMINAL.has(item.status)) this.watch();
  }

  /** A background subagent outlives the turn that started it, whose events stop before it ends: its
   * own buffer says how it ends (docs/agents.md#background-subagents). */
  async watch() {
    if (this.watching) return;
    this.watching = true;
    let text = "";
    try {
      await follow(
        (lastId) => api(this.streamUrl(), { headers: resumeHeaders(lastId) }),
        (ev) => {
          if (ev.type === "text-delta") text += ev.textDelta;
          else if (ev.type === "done") this.set({ ...this.item, status: "completed", summary: text, error: "" });
          else if (ev.type === "error") {
            const status = ev.code === "cancelled" ? "cancelled" : "failed";
            this.set({ ...this.item, status, summary: text, error: `${ev.code}: ${ev.message}` });
          }
        },
      );
    } catch {
      // Left as it is: reading the chat again shows its row.
    }
    this.onChange();
  }

  /** The error as text, or the summary as markdown (rendered again only when it changed). */
  setResult({ error = "", summary = "" }) {
    const key = error ? `error:${error}` : `summary:${summary}`;
    if (key === this.resultText) return;
    this.resultText = key;
    this.result.classList.toggle("error", Boolean(error));
    this.result.classList.toggle("markdown", !error);
    if (error) this.result.textContent = error;
    else renderMarkdown(this.result, summary);
    this.result.hidden = !error && !summary;
    this.result.classList.add("folded");
    requestAnimationFrame(() => {
      const long = this.result.scrollHeight > this.result.clientHeight + 2;
      this.result.classList.toggle("folded", long && this.more.getAttribute("aria-expanded") !== "true");
      this.more.hidden = !long && this.more.getAttribute("aria-expanded") !== "true";
    });
  }

  /** Shows the whole result (or folds it again). */
  unfold() {
    const open = this.more.getAttribute("aria-expanded") !== "true";
    this.more.setAttribute("aria-expanded", String(open));
    this.more.textContent = open ? "Show less" : "Show all";
    this.result.classList.toggle("folded", !open);
  }

  /** Shows (and follows, while it runs) the text of GET /api/subagents/{id}/stream. */
  async toggle() {
    this.live.hidden = !this.live.hidden;
    this.el.querySelector(".sub-head").setAttribute("aria-expanded", String(!this.live.hidden));
    if (this.live.hidden || this.loading) return;
    this.loading = true;
    const text = this.liveText;
    text.set("");
    text.flush();
    this.live.dataset.state = "loading";
    try {
      const result = await follow(
        (lastId) => api(this.streamUrl(), { headers: resumeHeaders(lastId) }),
        (ev) => {
          if (ev.type === "text-delta") text.append(ev.textDelta);
          else if (ev.type === "error") this.liveError(ev);
        },
      );
      if (!result.ended && !text.text) {
        // No buffer: not started yet, or its live output has expired: the stored trace has the reply.
        text.set(TERMINAL.has(this.status) ? await this.storedReply() : "(not started yet)");
      }
    } catch (err) {
      this.liveError(err);
    } finally {
      text.flush();
      this.loading = false;
      this.live.dataset.state = "loaded";
    }
  }

  liveError(err) {
    this.live.querySelector(".sub-live-error")?.remove();
    this.live.append(h("div", { class: "sub-live-error", dataset: { code: errorCode(err) } }, errorText(err)));
  }

  async storedReply() {
    if (!this.traceId) return "(no output)";
    const { messages } = await json(`/api/sessions/${encodeURIComponent(this.traceId)}/messages`);
    return messages.filter((m) => m.role === "assistant").at(-1)?.content || "(no output)";
  }
}
