// The runs page (#/runs): the caller's running and recent runs across every trace (GET /api/runs):
// chat turns, agent-invoke callees, subagents and the A2A tasks served to clients, newest first, with
// their state, agent, parent, age and tokens. It refreshes while anything on it runs. A chat turn opens
// its chat (a link); any other run opens its trace in the side panel, following it live while it runs.
// Stop reuses the cancel routes: a chat turn's own, the root chat turn's for a callee or a subagent
// (that stops the turn and everything under it), a background subagent's own (it outlives the turn
// that started it), the A2A CancelTask for a task served to a client.
// RunsBadge keeps the sidebar's count of running work.

import { api, json } from "./api.js";
import { h } from "./dom.js";
import { errorText } from "./errors.js";
import { ago, fullDate } from "./time.js";

const enc = encodeURIComponent;
export const KIND_LABEL = { chat: "chat", callee: "agent-invoke", subagent: "subagent", a2a: "A2A task" };
const STATES = [
  ["", "All runs"],
  ["running", "Running"],
  ["done", "Done"],
  ["failed", "Failed"],
  ["cancelled", "Cancelled"],
  ["interrupted", "Interrupted"],
];
const REFRESH_MS = 1500; // the page, while a run on it runs
const BADGE_BUSY_MS = 1500; // the badge, while something runs (or a turn of this page does)
const BADGE_IDLE_MS = 20000; // the badge, while nothing does

/** The URL that follows a run live (the panel's stream), or "" for a chat turn (its chat resumes it). */
export function streamUrl(run) {
  if (run.kind === "subagent" && run.subagentId) return `/api/subagents/${enc(run.subagentId)}/stream`;
  if (run.taskId) return `/api/agents/a2a/stream?taskId=${enc(run.taskId)}`;
  return "";
}

function duration(run, now = Date.now()) {
  const start = Date.parse(run.startTime);
  const end = run.endTime ? Date.parse(run.endTime) : now;
  if (Number.isNaN(start) || Number.isNaN(end)) return "";
  const s = Math.max(0, Math.round((end - start) / 1000));
  if (s < 60) return `${s} s`;
  if (s < 3600) return `${Math.floor(s / 60)} min ${s % 60} s`;
  return `${Math.floor(s / 3600)} h ${Math.floor((s % 3600) / 60)} min`;
}

function tokens(run) {
  const n = (run.usage?.inputTokens ?? 0) + (run.usage?.outputTokens ?? 0);
  return n ? `${n.toLocaleString()} tokens` : "";
}

export class RunsPage {
  /** hooks: onOpenRun(run) for a run that is not a chat turn; onCount(n) with the running count seen;
   * onMenu() for the page's own menu button (a phone: the chat's header with its button is hidden). */
  constructor({ root, onOpenRun = () => {}, onCount = () => {}, onMenu = () => {} }) {
    Object.assign(this, { root, onOpenRun, onCount });
    this.runs = [];
    this.next = "";
    this.timer = null;
    this.visible = false;
    this.loading = 0;
    this.state = h(
      "select",
      { id: "runs-state", onchange: () => this.load({ reset: true }) },
      STATES.map(([value, label]) => h("option", { value }, label)),
    );
    this.status = h("p", { id: "runs-status", class: "runs-status muted", role: "status" });
    this.list = h("ul", { id: "runs-list", class: "runs-list", "aria-label": "Runs" });
    this.more = h("button", { type: "button", id: "runs-more", class: "link", hidden: true, onclick: () => this.load({ more: true }) }, "Older runs");
    this.error = h("p", { class: "form-error", role: "alert", hidden: true });
    root.replaceChildren(
      h(
        "header",
        { class: "agents-header runs-header" },
        h("button", { type: "button", class: "icon menu", "aria-label": "Show chats", "aria-controls": "sidebar", "aria-expanded": "false", onclick: onMenu }, "☰"),
        h("h1", {}, "Runs"),
        h("span", { class: "runs-filter" }, h("label", { for: "runs-state" }, "Show"), this.state),
      ),
      h("div", { class: "runs-body" }, this.status, this.error, this.list, this.more),
    );
  }

  async open(state = "") {
    this.visible = true;
    this.state.value = STATES.some(([v]) => v === state) ? state : "";
    this.list.replaceChildren();
    this.status.textContent = "Loading…";
    await this.load({ reset: true });
  }

  close() {
    this.visible = false;
    clearTimeout(this.timer);
    this.timer = null;
  }

  /** The first page again (or the next one, with `more`; with `reset`, only the first page, as for a new
   * filter); refreshes itself while anything runs. */
  async load({ more = false, reset = false } = {}) {
    clearTimeout(this.timer);
    if (reset) {
      this.runs = [];
      this.next = "";
    }
    const token = ++this.loading;
    const params = new URLSearchParams({ page_size: "50" });
    if (this.state.value) params.set("state", this.state.value);
    if (more && this.next) params.set("page_token", this.next);
    let page;
    try {
      page = await json(`/api/runs?${params}`);
    } catch (err) {
      if (token !== this.loading || !this.visible) return;
      this.error.textContent = errorText(err);
      this.error.hidden = false;
      this.schedule();
      return;
    }
    if (token !== this.loading || !this.visible) return;
    this.error.hidden = true;
    if (more) {
      const seen = new Set(this.runs.map((r) => r.messageId));
      this.runs = this.runs.concat(page.runs.filter((r) => !seen.has(r.messageId)));
    } else {
      // A refresh keeps the older pages the user asked for: the new first page, then what was below it.
      const fresh = new Set(page.runs.map((r) => r.messageId));
      const last = page.runs.at(-1);
      const older = last ? this.runs.filter((r) => !fresh.has(r.messageId) && r.startTime < last.startTime) : [];
      this.runs = page.runs.concat(this.runs.length > page.runs.length ? older : []);
      this.next = page.nextPageToken;
    }
    if (more) this.next = page.nextPageToken;
    this.render();
    this.schedule();
  }

  schedule() {
    clearTimeout(this.timer);
    if (this.visible && this.runs.some((r) => r.state === "running")) this.timer = setTimeout(() => this.load(), REFRESH_MS);
  }

  render() {
    const running = this.runs.filter((r) => r.state === "running").length;
    if (!this.state.value || this.state.value === "running") this.onCount(running);
    const focused = document.activeElement?.closest?.(".run")?.dataset.messageId;
    const what = this.state.value ? this.state.selectedOptions[0].textContent.toLowerCase() : "runs";
    this.status.textContent = !this.runs.length
      ? this.state.value ? `No ${what}.` : "No runs yet: a chat turn, an agent-invoke call or a subagent shows here while it runs and after."
      : running ? `${running} running` : "";
    const byTrace = new Map(this.runs.map((r) => [r.traceId, r]));
    this.list.replaceChildren(...this.runs.map((r) => this.item(r, byTrace)));
    this.more.hidden = !this.next;
    if (focused) this.list.querySelector(`.run[data-message-id="${focused}"] .run-open`)?.focus();
  }

  item(run, byTrace) {
    const name = run.title || run.agent || "Untitled";
    const parent = run.parentTraceId ? byTrace.get(run.parentTraceId) : null;
    const open =
      run.kind === "chat"
        ? h("a", { class: "run-open", href: `#/s/${enc(run.traceId)}`, title: "Open the chat" }, name)
        : h("button", { type: "button", class: "link run-open", title: "Open its trace in the side panel", onclick: () => this.onOpenRun(run) }, name);
    const from = run.parentTraceId
      ? parent?.kind === "chat"
        ? h("a", { href: `#/s/${enc(parent.traceId)}`, class: "run-parent" }, `from ${parent.title || parent.agent || "a chat"}`)
        : h("span", { class: "run-parent" }, run.callerAgent ? `from ${run.callerAgent}` : "from another run")
      : null;
    const meta = [
      h("span", { title: fullDate(run.startTime) }, `started ${ago(run.startTime)}`),
      h("span", {}, run.state === "running" ? `running ${duration(run)}` : duration(run)),
      tokens(run) && h("span", {}, tokens(run)),
      from,
    ].filter(Boolean);
    const stop =
      run.state === "running" &&
      h(
        "button",
        {
          type: "button",
          class: "danger run-stop",
          "aria-label": `Stop ${name}`,
          title: run.kind === "chat" || run.kind === "a2a" ? "Stop this run and everything under it" : "Stop the turn that started it, and everything under it",
          onclick: (e) => this.stop(run, e.currentTarget),
        },
        "Stop",
      );
    return h(
      "li",
      { class: "run", dataset: { messageId: String(run.messageId), state: run.state, kind: run.kind } },
      h(
        "div",
        { class: "run-main" },
        h("span", { class: "badge run-state", dataset: { status: run.state } }, run.state),
        h("span", { class: "run-title" }, open),
        h("span", { class: "run-agent" }, run.agent, " · ", KIND_LABEL[run.kind] ?? run.kind),
      ),
      h("div", { class: "run-meta" }, meta.flatMap((m, i) => (i ? [" · ", m] : [m]))),
      run.error && run.state !== "done" ? h("p", { class: "run-error" }, run.error) : null,
      stop,
    );
  }

  /** The chat turn at the root of a run (itself, or up its parents as far as the list knows them). */
  rootTurn(run) {
    const byTrace = new Map(this.runs.map((r) => [r.traceId, r]));
    let at = run;
    for (let i = 0; i < 10 && at.kind !== "chat" && at.parentTraceId; i++) {
      const up = byTrace.get(at.parentTraceId);
      if (!up) return { traceId: at.parentTraceId };
      at = up;
    }
    return at;
  }

  async stop(run, button) {
    button.disabled = true;
    try {
      if (run.kind === "a2a") {
        const res = await json(`/a2a/${enc(run.agent)}`, {
          method: "POST",
          body: { jsonrpc: "2.0", id: 1, method: "tasks/cancel", params: { id: run.taskId } },
        });
        if (res.error) throw new Error(res.error.message || "the task could not be stopped");
      } else if (run.kind === "subagent" && run.background) {
        // A background subagent outlives the turn that started it: it stops on its own.
        await api(`/api/subagents/${enc(run.subagentId)}/cancel`, { method: "POST" });
      } else {
        await api(`/api/sessions/${enc(this.rootTurn(run).traceId)}/cancel`, { method: "POST" });
      }
    } catch (err) {
      this.error.textContent = errorText(err);
      this.error.hidden = false;
      button.disabled = false;
      return;
    }
    await this.load();
  }
}

/** The sidebar's badge: how many runs of the caller are running, polled (sooner while any are). */
export class RunsBadge {
  constructor(el) {
    this.el = el;
    this.count = 0;
    this.timer = null;
    this.active = false;
    this.busy = false; // a turn of this page runs: its runs count too, soon
  }

  /** This page's own turn began (busy) or ended: ask now, and often while it runs. */
  watch(busy) {
    this.busy = busy;
    this.refresh();
  }

  start() {
    this.active = true;
    this.refresh();
  }

  stop() {
    this.active = false;
    clearTimeout(this.timer);
    this.set(0);
  }

  /** Asks now (a turn began or ended), then on the usual schedule. */
  async refresh() {
    clearTimeout(this.timer);
    if (!this.active) return;
    try {
      const page = await json("/api/runs?state=running&page_size=200");
      this.set(page.runs.length, Boolean(page.nextPageToken));
    } catch {
      // the next round asks again; a 401 signs the user out (api.js)
    }
    if (this.active) this.timer = setTimeout(() => this.refresh(), this.count || this.busy ? BADGE_BUSY_MS : BADGE_IDLE_MS);
  }

  set(count, more = false) {
    this.count = count;
    this.el.hidden = !count;
    this.el.textContent = more ? `${count}+` : String(count);
    this.el.title = `${count}${more ? "+" : ""} running`;
    this.el.nextElementSibling?.replaceChildren(count ? ` (${count}${more ? "+" : ""} running)` : "");
  }
}
