// The side panel (docs/requirements.md#invoke-side-panel): read-only. An agent-invoke call opens it once
// its task exists (`a2a-task-started`; a call refused before that never opens it, its tool card shows
// the error); it follows GET /api/agents/a2a/stream?taskId=... and shows the callee's task at the top
// and its reply as it streams (markdown, re-rendered at most once per animation frame), then how it
// ended. A stream that drops for good says so. From the history, a tool card or a subagent row opens
// a delegated run's trace: its stored messages, and its live stream while it still runs. Every run
// has a tab named by its agent and a short form of its task; a closed panel opens again on the run's
// tab (from its tool card's "open") and has followed the run meanwhile. On a narrow screen the panel
// lies over the chat; Escape closes it (app.js).

import { api, json } from "./api.js";
import { h, preview } from "./dom.js";
import { errorCode, errorText } from "./errors.js";
import { LiveMarkdown } from "./markdown.js";
import { follow, resumeHeaders } from "./sse.js";

const LABELS = { loading: "loading…", streaming: "streaming…", done: "done", error: "failed", cancelled: "cancelled" };
const LOST = "The connection to this stream was lost; the reply is saved and can be opened again from the history.";

export class InvokePanel {
  constructor(root) {
    this.root = root;
    this.heading = root.querySelector("#invoke-title");
    this.status = root.querySelector("#invoke-status");
    this.tabs = root.querySelector("#invoke-tabs");
    this.body = root.querySelector("#invoke-body");
    this.text = new LiveMarkdown(h("div", { class: "panel-text" }), (render) => {
      const end = this.atEnd();
      render();
      if (end) this.body.scrollTop = this.body.scrollHeight;
    });
    root.querySelector("#invoke-close").addEventListener("click", () => this.hide());
    this.calls = [];
    this.shown = null;
    this.opener = null; // the element focus returns to when the panel closes
  }

  get open() {
    return !this.root.hidden;
  }

  /** Forgets every run and stops following their streams (another session was opened). */
  reset() {
    for (const call of this.calls) call.abort.abort();
    this.text.cancel();
    this.calls = [];
    this.shown = null;
    this.hide(false);
  }

  hide(restoreFocus = true) {
    const had = this.root.contains(document.activeElement);
    this.root.hidden = true;
    document.body.classList.remove("panel-open");
    if (restoreFocus && had) (this.opener?.isConnected ? this.opener : document.getElementById("input"))?.focus();
  }

  show(call, { focus = false } = {}) {
    this.shown = call;
    this.root.hidden = false;
    document.body.classList.add("panel-open");
    this.render();
    if (focus) this.heading.focus();
  }

  /** a2a-task-started: the callee's name, its task (the tool's input) and the stream to follow. */
  taskStarted(ev, input) {
    const call = this.add(ev.calleeAgentName || ev.calleeAgentSlug || "agent", "streaming");
    call.toolCallId = ev.toolCallId;
    call.taskId = ev.taskId;
    call.traceId = ev.localTraceId || ev.traceId; // our record of a remote callee's exchange, if any
    call.streamUrl = `/api/agents/a2a/stream?taskId=${encodeURIComponent(ev.taskId)}`;
    if (typeof input === "string") call.task = input;
    else this.loadTask(call); // several inputs run in parallel: the callee's trace says which is its
    this.show(call);
    this.subscribe(call);
  }

  async loadTask(call) {
    // The callee's trace has its task once its turn is stored, right after the task started.
    for (let attempt = 0; attempt < 20 && this.calls.includes(call); attempt++) {
      try {
        const { messages } = await json(`/api/traces/${encodeURIComponent(call.traceId)}/messages?limit=1`);
        const task = messages.find((m) => m.role === "user")?.content;
        if (task) {
          call.task = task;
          if (this.calls.includes(call)) this.render();
          return;
        }
      } catch {
        /* not there yet */
      }
      await new Promise((resolve) => setTimeout(resolve, 250));
    }
  }

  /** tool-output-available: settles the calls of that tool call whose stream could not tell their end. */
  toolOutput(ev) {
    for (const call of this.calls.filter((c) => c.toolCallId === ev.toolCallId)) {
      call.result = ev;
      if (!call.live) this.settle(call);
    }
  }

  /** The turn ended: a call still marked streaming whose stream is gone ends as its turn did. */
  turnEnded(error) {
    for (const call of this.calls) {
      if (call.status !== "streaming" || call.live) continue;
      call.status = errorCode(error) === "cancelled" ? "cancelled" : error ? "error" : "done";
    }
    this.render();
  }

  /** Opens a delegated run: the run already followed here (by its task), else its trace from the
   * history: {name, task?, traceId, streamUrl, taskId?, opener?}. */
  async openTrace({ name, task = "", traceId, streamUrl, taskId = "", opener = null }) {
    this.opener = opener;
    const known = this.calls.find((c) => (taskId && c.taskId === taskId) || (streamUrl && c.streamUrl === streamUrl && c.live));
    if (known) return this.show(known, { focus: true });
    const call = this.add(name, "loading");
    call.task = task;
    call.taskId = taskId;
    call.traceId = traceId;
    this.show(call, { focus: true });
    try {
      // The trace API takes every id form: local, @alias/id and agent://host:port/id (a peer's trace,
      // read through this mesh's cached copy; `stale` when the peer did not answer).
      const { messages, stale } = await json(`/api/traces/${encodeURIComponent(traceId)}/messages`);
      const reply = messages.filter((m) => m.role === "assistant").at(-1);
      call.task = messages.find((m) => m.role === "user")?.content ?? call.task;
      if (streamUrl && (reply?.status === "pending" || (reply && !reply.content && reply.status !== "completed"))) {
        // Still running, or ended before its text was stored: its buffer has the text while it exists.
        call.status = "streaming";
        call.streamUrl = streamUrl;
        this.render();
        await this.subscribe(call);
        if (call.text || reply?.status === "pending") return;
      }
      call.text = (stale ? "(cached copy: the peer's mesh did not answer)\n\n" : "") + (reply?.content ?? "");
      call.status = !reply || reply.status === "completed" ? "done" : reply.status === "cancelled" ? "cancelled" : "error";
      const error = reply?.metadata?.error;
      if (error && reply.status !== "completed") call.error = errorText(error);
    } catch (err) {
      call.status = "error";
      call.error = errorText(err);
    }
    if (call === this.shown) this.render();
  }

  /** Ends a call from its tool output, unless its stream already told the end (or there is no output yet). */
  settle(call) {
    const ev = call.result;
    if (!ev || call.status === "done" || call.status === "error" || call.status === "cancelled") return;
    const code = ev.output?.code;
    call.status = ev.ok && ev.output?.ok !== false ? "done" : code === "cancelled" ? "cancelled" : "error";
    if (call.status === "error" && !call.error) call.error = errorText(code || "failed");
    if (!call.text) call.text = outputText(ev.output);
    this.render();
  }

  add(name, status) {
    const call = { name, status, toolCallId: "", taskId: "", traceId: "", streamUrl: "", task: "", text: "", error: "", live: false };
    call.result = null; // the tool-output-available event, once it came
    call.abort = new AbortController();
    this.calls.push(call);
    return call;
  }

  async subscribe(call) {
    const { signal } = call.abort;
    call.live = true;
    try {
      const result = await follow(
        (lastId) => api(call.streamUrl, { headers: resumeHeaders(lastId), signal }),
        (ev) => this.onEvent(call, ev),
      );
      call.live = false;
      // No buffer any more (the run ended long ago) or a stream that dropped for good: the tool output
      // or the stored trace tells the end; a dropped stream says so.
      if (!result.ended && !result.body) call.error = LOST;
    } catch (err) {
      if (err.name === "AbortError") return;
      call.live = false;
      call.error = errorText(err);
    }
    this.settle(call);
    this.render();
  }

  onEvent(call, ev) {
    if (ev.type === "text-delta") {
      call.text += ev.textDelta;
      if (call !== this.shown) return;
      if (this.text.el.isConnected) this.text.set(call.text); // rendered on the next animation frame
      else this.render(); // the first text replaces "Waiting for the reply…"
      return;
    }
    if (ev.type === "done") call.status = "done";
    else if (ev.type === "error") {
      call.status = errorCode(ev) === "cancelled" ? "cancelled" : "error";
      call.error = errorText(ev);
    } else return;
    this.render();
  }

  atEnd() {
    const b = this.body;
    return b.scrollHeight - b.scrollTop - b.clientHeight < 60;
  }

  render() {
    const call = this.shown;
    if (!call) return;
    this.heading.textContent = call.name;
    this.status.textContent = LABELS[call.status];
    this.status.dataset.status = call.status;
    this.body.setAttribute("aria-busy", String(call.status === "streaming" || call.status === "loading"));
    const end = this.atEnd();
    if (this.text.el.dataset.call !== String(this.calls.indexOf(call))) {
      this.text.set(""); // another run: its text is rendered afresh
      this.text.flush();
      this.text.el.dataset.call = String(this.calls.indexOf(call));
    }
    this.text.set(call.text);
    this.text.flush();
    const wait = call.status === "loading" ? "Loading…" : call.status === "streaming" ? "Waiting for the reply…" : "(no reply)";
    const text = call.text ? this.text.el : h("div", { class: "panel-wait" }, wait);
    const task = call.task && h("div", { class: "panel-task" }, h("span", { class: "panel-label" }, "Task"), call.task);
    const error = call.error && h("div", { class: "panel-error", role: "alert" }, call.error);
    this.body.replaceChildren(task || "", text, error || "");
    if (end) this.body.scrollTop = this.body.scrollHeight;
    this.tabs.hidden = this.calls.length < 2;
    this.tabs.replaceChildren(
      ...this.calls.map((c) =>
        h(
          "button",
          {
            type: "button",
            role: "tab",
            class: c === call ? "tab active" : "tab",
            "aria-selected": String(c === call),
            "aria-controls": "invoke-body",
            title: c.task ? `${c.name}: ${c.task}` : c.name,
            dataset: { status: c.status },
            onclick: () => this.show(c),
          },
          tabLabel(c),
        ),
      ),
    );
  }
}

/** The agent's name and a short form of its task: "Coding Assistant · write fizzbuzz in…". */
export function tabLabel(call) {
  return call.task ? `${call.name} · ${preview(call.task, 28)}` : call.name;
}

function outputText(output) {
  if (typeof output === "string") return output;
  if (output?.ok === false) return "";
  return output?.output ?? preview(output ?? "", 500);
}
