// One chat turn at a time: POST /api/chat (or GET /api/sessions/{id}/stream to resume one), the SSE
// events dispatched into the message views, the agent-invoke panel and the subagent cards.

import { api, json } from "./api.js";
import { follow, resumeHeaders } from "./sse.js";

export class ChatController {
  /** hooks: onSession(id) at `start`, onBusy(bool), onEnd(sessionId) after the stream ends. */
  constructor({ view, panel, onSession, onBusy, onEnd }) {
    Object.assign(this, { view, panel, onSession, onBusy, onEnd });
    this.sessionId = null;
    this.current = null; // the assistant view of the turn
    this.abort = null;
    this.started = false; // `start` seen: the turn exists on the server and can be cancelled
    this.cancelRequested = false;
  }

  get busy() {
    return this.abort !== null;
  }

  /** Sends a message; a new session is created when sessionId is empty. */
  send({ agent, message, sessionId }) {
    this.sessionId = sessionId || null;
    this.view.addUser(message);
    this.current = this.view.addAssistant();
    this.current.setStreaming(true);
    let posted = false;
    return this.run((lastId, signal) => {
      if (posted) return this.resumeFetch(lastId, signal);
      posted = true;
      const body = { agent, message, ...(sessionId ? { sessionId } : {}) };
      return api("/api/chat", { method: "POST", body, signal });
    });
  }

  /** Follows the running turn of a session from the start of its buffer (after a page reload). */
  resume(sessionId) {
    this.sessionId = sessionId;
    this.current = null;
    return this.run((lastId, signal) => this.resumeFetch(lastId, signal));
  }

  resumeFetch(lastId, signal) {
    if (!this.sessionId) throw new Error("connection lost before the turn started");
    const url = `/api/sessions/${encodeURIComponent(this.sessionId)}/stream`;
    return api(url, { headers: resumeHeaders(lastId), signal });
  }

  /** Stops reading (the turn itself goes on on the server). */
  detach() {
    this.abort?.abort();
    this.abort = null;
    this.onBusy(false);
  }

  /** POST /api/sessions/{id}/cancel: stops the turn and every run under it. */
  async cancel() {
    this.cancelRequested = !this.started; // too early: cancel as soon as `start` arrives
    if (this.started) await api(`/api/sessions/${encodeURIComponent(this.sessionId)}/cancel`, { method: "POST" });
  }

  async run(open) {
    this.abort?.abort();
    const abort = (this.abort = new AbortController());
    this.started = this.cancelRequested = false;
    this.onBusy(true);
    try {
      const result = await follow((lastId) => open(lastId, abort.signal), (ev) => this.dispatch(ev));
      if (!result.ended && !result.body) this.fail({ code: "disconnected", message: "the connection was lost" });
    } catch (err) {
      if (!abort.signal.aborted) this.fail({ code: err.reason?.toLowerCase() || "", message: err.message });
    } finally {
      if (this.abort === abort) {
        this.abort = null;
        this.current?.setStreaming(false);
        this.onBusy(false);
        this.onEnd(this.sessionId);
      }
    }
  }

  fail(error) {
    (this.current ?? this.view.addAssistant()).error(error);
  }

  dispatch(ev) {
    const cur = this.current;
    switch (ev.type) {
      case "start":
        this.start(ev);
        break;
      case "text-delta":
        cur?.appendText(ev.textDelta);
        break;
      case "reasoning-delta":
        cur?.appendReasoning(ev.reasoningDelta);
        break;
      case "tool-input-available":
        cur?.toolInput(ev);
        break;
      case "tool-output-available":
        cur?.toolOutput(ev);
        if (ev.toolName === "agent-invoke") this.panel.toolOutput(ev);
        break;
      case "a2a-task-started":
        this.panel.taskStarted(ev);
        break;
      case "subagent-batch-start":
        this.anchor(ev)?.batchStart(ev);
        break;
      case "subagent-update":
        this.anchor(ev)?.subagentUpdate(ev);
        break;
      case "subagent-done":
        this.anchor(ev)?.subagentDone(ev);
        break;
      case "finish":
        cur?.finish(ev);
        cur?.setStreaming(false);
        break;
      case "error":
        this.fail(ev);
        if (cur?.batches.length) this.refreshBatches(cur).catch(() => {});
        break;
      default:
        return;
    }
    this.view.scroll();
  }

  /** `start`: the session and the assistant message (the anchor) of the turn. */
  start(ev) {
    this.sessionId = ev.traceId;
    const saved = this.view.assistant(ev.assistantMessageId);
    if (saved) {
      saved.reset(); // a resumed turn replays from its first event
      this.current = saved;
    } else if (this.current && this.current.id == null) {
      this.view.bind(this.current, ev.assistantMessageId);
    } else {
      this.current = this.view.addAssistant(ev.assistantMessageId);
    }
    this.current.setStreaming(true);
    this.started = true;
    this.onSession(ev.traceId);
    if (this.cancelRequested) this.cancel().catch((err) => this.fail(err));
  }

  /** A turn that failed or was cancelled ends its stream before its subagents are settled: the cards
   * take their final state from the stored rows, once none of them is running any more. */
  async refreshBatches(view) {
    const url = `/api/sessions/${encodeURIComponent(this.sessionId)}/messages`;
    for (let attempt = 0; attempt < 20; attempt++) {
      const { messages } = await json(url);
      const batches = messages.find((m) => String(m.id) === String(view.id))?.metadata?.subagents;
      if (batches) view.replaceBatches(batches);
      if (!batches || batches.every((b) => !b.summary?.running)) return;
      await new Promise((resolve) => setTimeout(resolve, 250));
    }
  }

  /** The assistant message a subagent event belongs to: the one whose id is its parentMessageId. */
  anchor(ev) {
    return this.view.assistant(ev.parentMessageId) ?? this.current;
  }
}
