// The agent-invoke side panel (seed 1): read-only, opened by an `agent-invoke` tool call, titled with
// the callee; after `a2a-task-started` it follows GET /api/agents/a2a/stream?taskId=... and shows the
// callee's reply as it streams (markdown, re-rendered at most once per animation frame), then "done"
// or "error". Several calls in a turn: the latest is shown, the others are a click away in the tab row.

import { api } from "./api.js";
import { h, preview } from "./dom.js";
import { LiveMarkdown } from "./markdown.js";
import { follow, resumeHeaders } from "./sse.js";

const LABELS = { waiting: "waiting…", streaming: "streaming…", done: "done", error: "error" };

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

  /** Forgets every call and stops following their streams (another session was opened). */
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

  /** tool-input-available with toolName agent-invoke. */
  toolInput(ev) {
    this.show(this.add(ev.toolCallId, ev.input?.agentSlug || "agent"));
  }

  /** a2a-task-started: the callee's name and the task whose stream to follow. */
  taskStarted(ev) {
    const call =
      this.calls.find((c) => c.toolCallId === ev.toolCallId && !c.taskId) ??
      this.add(ev.toolCallId, ev.calleeAgentSlug);
    call.taskId = ev.taskId;
    call.name = ev.calleeAgentName || ev.calleeAgentSlug || call.name;
    call.status = "streaming";
    this.show(call);
    this.subscribe(call);
  }

  /** tool-output-available: kept by each of its calls; settles those with no live stream to tell their end. */
  toolOutput(ev) {
    for (const call of this.calls.filter((c) => c.toolCallId === ev.toolCallId)) {
      call.result = ev;
      if (!call.live) this.settle(call);
    }
  }

  /** Ends a call from its tool output, unless its stream already told the end (or it has no output yet). */
  settle(call) {
    const ev = call.result;
    if (!ev || call.status === "done" || call.status === "error") return;
    call.status = ev.ok && ev.output?.ok !== false ? "done" : "error";
    if (!call.text) call.text = outputText(ev.output);
    this.render();
  }

  add(toolCallId, slug) {
    const call = { toolCallId, name: slug, taskId: "", text: "", status: "waiting", error: "", live: false };
    call.result = null; // the tool-output-available event, once it came
    call.abort = new AbortController();
    this.calls.push(call);
    return call;
  }

  async subscribe(call) {
    const url = `/api/agents/a2a/stream?taskId=${encodeURIComponent(call.taskId)}`;
    const { signal } = call.abort;
    call.live = true;
    try {
      // The callee's buffer may not exist yet when a2a-task-started arrives (`no-buffer`): ask again,
      // backing off, until it does or the tool output has ended the call.
      for (let attempt = 0, wait = 200; ; attempt++, wait = Math.min(2 * wait, 2000)) {
        const result = await follow(
          (lastId) => api(url, { headers: resumeHeaders(lastId), signal }),
          (ev) => this.onEvent(call, ev),
        );
        if (result.ended) break;
        if (result.body?.reason !== "no-buffer" || call.result || attempt >= 40) {
          call.live = false; // no live stream: the tool output settles the call
          break;
        }
        await sleep(wait, signal);
        if (signal.aborted) return;
      }
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
      call.status = "error";
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
    const text = call.text
      ? this.text.el
      : h("div", { class: "panel-wait" }, call.status === "done" ? "(no reply)" : "Waiting for the reply…");
    const error = call.error && h("div", { class: "panel-error", role: "alert" }, call.error);
    this.body.replaceChildren(text, error || "");
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

/** Resolves after ms, or at once when the signal aborts. */
function sleep(ms, signal) {
  return new Promise((resolve) => {
    const timer = setTimeout(resolve, ms);
    signal.addEventListener("abort", () => (clearTimeout(timer), resolve()), { once: true });
  });
}

function outputText(output) {
  if (typeof output === "string") return output;
  return output?.output ?? output?.error ?? preview(output ?? "", 500);
}
