// The side panel (docs/requirements.md#invoke-side-panel): read-only. An agent-invoke call opens it once its
// task exists
// (`a2a-task-started`; a call refused before that never opens it, its tool card shows the error); it
// follows GET /api/agents/a2a/stream?taskId=... and shows the callee's reply as it streams (markdown,
// re-rendered at most once per animation frame), then "done" or "error". A stream that drops for good
// says so. From the history, a tool card or a subagent row opens a delegated run's trace: its stored
// messages, and its live stream while it still runs. Several runs: the latest is shown, the others are
// a click away in the tab row.

import { api, json } from "./api.js";
import { h, preview } from "./dom.js";
import { LiveMarkdown } from "./markdown.js";
import { follow, resumeHeaders } from "./sse.js";

const LABELS = { loading: "loading…", streaming: "streaming…", done: "done", error: "error", cancelled: "cancelled" };
const LOST = "The connection to this stream was lost; the reply is saved and can be opened again from the history.";

export class InvokePanel {
  constructor(root) {
    this.root = root;
    this.title = root.querySelector("#invoke-title");
    this.status = root.querySelector("#invoke-status");
    this.tabs = root.querySelector("#invoke-tabs");
    this.body = root.querySelector("#invoke-body");
    this.text = new LiveMarkdown(h("div", { class: "panel-text" }), (render) => {
      render();
      this.body.scrollTop = this.body.scrollHeight;
    });
    root.querySelector("#invoke-close").addEventListener("click", () => this.hide());
    this.calls = [];
    this.shown = null;
  }

  /** Forgets every run and stops following their streams (another session was opened). */
  reset() {
    for (const call of this.calls) call.abort.abort();
    this.text.cancel();
    this.calls = [];
    this.shown = null;
    this.hide();
  }

  hide() {
    this.root.hidden = true;
    document.body.classList.remove("panel-open");
  }

  show(call) {
    this.shown = call;
    this.root.hidden = false;
    document.body.classList.add("panel-open");
    this.render();
  }

  /** a2a-task-started: the callee's name and the task whose stream to follow. */
  taskStarted(ev) {
    const call = this.add(ev.calleeAgentName || ev.calleeAgentSlug || "agent", "streaming");
    call.toolCallId = ev.toolCallId;
    call.streamUrl = `/api/agents/a2a/stream?taskId=${encodeURIComponent(ev.taskId)}`;
    this.show(call);
    this.subscribe(call);
  }

  /** tool-output-available: settles the calls of that tool call whose stream could not tell their end. */
  toolOutput(ev) {
    for (const call of this.calls.filter((c) => c.toolCallId === ev.toolCallId)) {
      call.result = ev;
      if (!call.live) this.settle(call);
    }
  }

  /** Opens a delegated run from the history: {name, traceId, streamUrl}. */
  async openTrace({ name, traceId, streamUrl }) {
    const call = this.add(name, "loading");
    this.show(call);
    try {
      // The trace API takes every id form: local, @alias/id and agent://host:port/id (a peer's trace,
      // read through this mesh's cached copy; `stale` when the peer did not answer).
      const { messages, stale } = await json(`/api/traces/${encodeURIComponent(traceId)}/messages`);
      const reply = messages.filter((m) => m.role === "assistant").at(-1);
      call.task = messages.find((m) => m.role === "user")?.content ?? "";
      if (reply?.status === "pending" && streamUrl) {
        call.status = "streaming";
        call.streamUrl = streamUrl;
        this.render();
        await this.subscribe(call);
        return;
      }
      call.text = (stale ? "(cached copy: the peer's mesh did not answer)\n\n" : "") + (reply?.content ?? "");
      call.status = !reply || reply.status === "completed" ? "done" : reply.status === "cancelled" ? "cancelled" : "error";
      const error = reply?.metadata?.error;
      if (error) call.error = `${error.code}: ${error.message}`;
    } catch (err) {
      call.status = "error";
      call.error = err.message;
    }
    if (call === this.shown) this.render();
  }

  /** Ends a call from its tool output, unless its stream already told the end (or there is no output yet). */
  settle(call) {
    const ev = call.result;
    if (!ev || call.status === "done" || call.status === "error" || call.status === "cancelled") return;
    call.status = ev.ok && ev.output?.ok !== false ? "done" : "error";
    if (!call.text) call.text = outputText(ev.output);
    this.render();
  }

  add(name, status) {
    const call = { name, status, toolCallId: "", streamUrl: "", task: "", text: "", error: "", live: false };
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
      call.error = err.message;
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
      call.status = ev.code === "cancelled" ? "cancelled" : "error";
      call.error = ev.message || ev.code;
    } else return;
    if (call === this.shown) this.render();
  }

  render() {
    const call = this.shown;
    if (!call) return;
    this.title.textContent = call.name;
    this.status.textContent = LABELS[call.status];
    this.status.dataset.status = call.status;
    this.text.set(call.text);
    this.text.flush();
    const wait = call.status === "loading" ? "Loading…" : call.status === "streaming" ? "Waiting for the reply…" : "(no reply)";
    const text = call.text ? this.text.el : h("div", { class: "panel-wait" }, wait);
    const task = call.task && h("div", { class: "panel-task" }, h("span", { class: "panel-label" }, "Task"), call.task);
    const error = call.error && h("div", { class: "panel-error", role: "alert" }, call.error);
    this.body.replaceChildren(task || "", text, error || "");
    this.body.scrollTop = this.body.scrollHeight;
    this.tabs.hidden = this.calls.length < 2;
    this.tabs.replaceChildren(
      ...this.calls.map((c, i) =>
        h(
          "button",
          { type: "button", class: c === call ? "tab active" : "tab", onclick: () => this.show(c) },
          `${i + 1}. ${c.name}`,
        ),
      ),
    );
  }
}

function outputText(output) {
  if (typeof output === "string") return output;
  return output?.output ?? output?.error ?? preview(output ?? "", 500);
}
