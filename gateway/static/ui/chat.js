// One chat turn at a time: POST /api/chat (or GET /api/sessions/{id}/stream to resume one), the SSE
// events dispatched into the message views, the agent-invoke panel and the subagent cards. When the
// turn's stream ends, the chat's stored messages (every branch) replace what the stream said: the
// tool cards, subagent cards and the turn's end show what was stored, live and after a reload alike.

import { api, json } from "./api.js";
import { chatBody, traceIdOf } from "./protocol.js";
import { follow, resumeHeaders } from "./sse.js";

const enc = encodeURIComponent;

/** Every message of a chat, on every branch: {messages, headSequence}. */
export async function loadMessages(traceId) {
  const all = [];
  let head = 0;
  for (let offset = 0; ; ) {
    const page = await json(`/api/sessions/${enc(traceId)}/messages?mode=all&limit=1000&offset=${offset}`);
    all.push(...page.messages);
    head = page.headSequence || head;
    offset += page.messages.length;
    if (!page.messages.length || offset >= (page.total ?? 0)) break;
  }
  return { messages: all, headSequence: head };
}

export class ChatController {
  /** hooks: onTrace(id) at `start`, onBusy(bool), onEnd(traceId) after the stream ended,
   * onRefused(err, {message, kind}) when a turn could not begin (an HTTP error answer). */
  constructor({ view, panel, onTrace, onBusy, onEnd, onRefused }) {
    Object.assign(this, { view, panel, onTrace, onBusy, onEnd, onRefused });
    this.traceId = null;
    this.current = null; // the assistant view of the turn
    this.abort = null;
    this.started = false; // `start` seen: the turn exists on the server and can be cancelled
    this.cancelRequested = false;
    this.ended = Promise.resolve();
  }

  get busy() {
    return this.abort !== null;
  }

  /** Sends a message; a new chat is created when traceId is empty. `replacing` (a stored user
   * message) makes the turn a new version of it: it branches from that message's parent. */
  send({ agent, message, traceId = null, parentSequence = null, replacing = null, kind = "send" }) {
    this.traceId = traceId || null;
    const { user, assistant } = this.view.beginTurn(message, replacing);
    this.user = user;
    this.current = assistant;
    assistant.setStreaming(true);
    let posted = false;
    return this.run(
      (lastId, signal) => {
        if (posted) return this.resumeFetch(lastId, signal);
        posted = true;
        const body = chatBody({ agent, message, traceId, parentSequence });
        return api("/api/chat", { method: "POST", body, signal });
      },
      { message, kind },
    );
  }

  /** Follows the running turn of a chat from the start of its buffer (after a page reload). */
  resume(traceId) {
    this.traceId = traceId;
    this.user = null;
    this.current = null;
    return this.run((lastId, signal) => this.resumeFetch(lastId, signal));
  }

  resumeFetch(lastId, signal) {
    if (!this.traceId) throw Object.assign(new Error("connection lost before the turn started"), { code: "disconnected" });
    return api(`/api/sessions/${enc(this.traceId)}/stream`, { headers: resumeHeaders(lastId), signal });
  }

  /** Stops reading (the turn itself goes on on the server). */
  detach() {
    this.abort?.abort();
    this.abort = null;
    if (this.current) this.current.live = false;
    this.view.setBusy(false);
    this.onBusy(false);
  }

  /** POST /api/sessions/{id}/cancel: stops the turn and every run under it. */
  async cancel() {
    this.cancelRequested = !this.started; // too early: cancel as soon as `start` arrives
    if (this.started) await api(`/api/sessions/${enc(this.traceId)}/cancel`, { method: "POST" });
  }

  async run(open, request = null) {
    this.abort?.abort();
    const abort = (this.abort = new AbortController());
    this.started = this.cancelRequested = false;
    this.view.setBusy(true);
    this.onBusy(true);
    let finished;
    this.ended = new Promise((resolve) => (finished = resolve));
    let error = null;
    try {
      const result = await follow((lastId) => open(lastId, abort.signal), (ev) => this.dispatch(ev));
      if (!result.ended && !result.body) this.fail((error = { code: "disconnected" }));
    } catch (err) {
      if (abort.signal.aborted) {
        // detached: another chat was opened
      } else if (!this.started && request && err.status) {
        this.view.dropTurn(); // the turn did not begin: nothing of it was stored
        this.current = null;
        this.onRefused(err, request);
      } else this.fail((error = err));
    } finally {
      if (this.abort === abort) {
        this.abort = null;
        this.current?.setStreaming(false);
        this.view.setBusy(false);
        this.onBusy(false);
        const view = this.current;
        if (this.started && view) await this.reconcile(view, this.traceId, error).catch(() => {});
        this.onEnd(this.traceId);
      }
      finished();
    }
  }

  fail(error) {
    if (!this.current) this.current = this.view.liveAssistant(`failed-${Date.now()}`);
    this.current.error(error);
    this.current.settle(error);
    this.panel.turnEnded(error);
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
        cur?.taskStarted(ev);
        this.panel.taskStarted(ev, cur?.tools.get(ev.toolCallId)?.input?.input);
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
        break;
      default:
        return;
    }
    this.view.scroll();
  }

  /** `start`: the chat and the turn's two messages (the assistant one is the subagents' anchor). */
  start(ev) {
    this.traceId = traceIdOf(ev);
    if (this.user) this.view.bind(this.user, ev.userMessageId);
    if (this.current && this.current.id == null) {
      this.view.bind(this.current, ev.assistantMessageId);
    } else {
      this.current = this.view.liveAssistant(ev.assistantMessageId);
      this.current.reset(); // a resumed turn replays from its first event
    }
    this.current.setStreaming(true);
    this.started = true;
    this.onTrace(this.traceId);
    if (this.cancelRequested) this.cancel().catch((err) => this.fail(err));
  }

  /** After the stream: the stored chat (every branch) and the turn as stored. A turn that failed or
   * was cancelled ends its stream before its subagents are settled: their cards follow the stored
   * rows until none of them runs any more. */
  async reconcile(view, traceId, error) {
    for (let attempt = 0; attempt < 40; attempt++) {
      const { messages, headSequence } = await loadMessages(traceId);
      if (this.traceId !== traceId || this.busy) return; // another chat or another turn meanwhile
      this.view.setMessages(messages, headSequence);
      const stored = messages.find((m) => String(m.id) === String(view.id));
      if (stored) {
        view.live = stored.status === "pending";
        view.reconcile(stored);
      } else view.live = false;
      if (error) view.settle(error);
      this.view.render();
      const running = stored?.metadata?.subagents?.some((b) => b.summary?.running);
      if (!running && stored?.status !== "pending") return;
      await new Promise((resolve) => setTimeout(resolve, 250));
    }
  }

  /** The assistant message a subagent event belongs to: the one whose id is its parentMessageId. */
  anchor(ev) {
    return this.view.assistant(ev.parentMessageId) ?? this.current;
  }
}
