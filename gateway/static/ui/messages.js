// The message list. An assistant message is, top to bottom
// (docs/requirements.md#subagent-cards): its subagent batch cards,
// its tool cards, its thinking block, its content (markdown, re-rendered at most once per animation
// frame while it streams). Live turns and restored history use the same views.

import { h } from "./dom.js";
import { LiveMarkdown } from "./markdown.js";
import { BatchCard } from "./subagents.js";
import { ToolCard } from "./tools.js";

export class AssistantView {
  constructor(id = null) {
    this.el = h("article", { class: "msg assistant" });
    this.around = (render) => render(); // the message list sets one that keeps the scroll pinned
    this.setId(id);
    this.reset();
  }

  setId(id) {
    this.id = id;
    if (id != null) this.el.dataset.messageId = id;
  }

  /** Empties the message (a resumed stream replays the turn from its start). */
  reset() {
    this.text?.cancel();
    this.batches = [];
    this.tools = new Map();
    this.batchBox = h("div", { class: "batches" });
    this.toolBox = h("div", { class: "tools" });
    this.thinkingText = h("div", { class: "thinking-text" });
    this.thinking = h("details", { class: "thinking", hidden: true }, h("summary", {}, "Thinking"), this.thinkingText);
    this.content = h("div", { class: "content" });
    this.text = new LiveMarkdown(this.content, (render) => this.around(render));
    this.foot = h("div", { class: "msg-foot" });
    const body = h("div", { class: "msg-body" }, this.batchBox, this.toolBox, this.thinking, this.content, this.foot);
    this.el.replaceChildren(h("div", { class: "avatar", "aria-hidden": "true" }, "A"), body);
    this.body = body;
  }

  /** A saved assistant message, with metadata.subagents and metadata.toolCalls. */
  static restore(msg) {
    const view = new AssistantView(msg.id);
    for (const batch of msg.metadata?.subagents ?? []) view.addBatch(BatchCard.restore(batch));
    for (const call of msg.metadata?.toolCalls ?? []) {
      view.toolInput({ toolCallId: call.id, toolName: call.name, input: call.input });
      if ("output" in call || "ok" in call) view.toolOutput({ toolCallId: call.id, ok: call.ok, output: call.output });
    }
    if (msg.thinking) view.appendReasoning(msg.thinking);
    view.appendText(msg.content || "");
    view.text.flush();
    if (msg.status === "failed") view.error(msg.metadata?.error ?? { code: "failed", message: "the turn failed" });
    if (msg.status === "cancelled") view.error({ code: "cancelled", message: "cancelled" });
    if (msg.status !== "pending") view.finish({ model: msg.model, usage: msg.usage });
    return view;
  }

  setStreaming(on) {
    this.el.classList.toggle("streaming", on);
    if (!on) this.text.flush();
  }

  appendText(text) {
    this.text.append(text);
  }

  appendReasoning(text) {
    this.thinking.hidden = false;
    this.thinkingText.append(text);
    this.thinkingText.normalize();
  }

  toolInput(ev) {
    const card = new ToolCard(ev);
    this.tools.set(ev.toolCallId, card);
    this.toolBox.append(card.el);
  }

  toolOutput(ev) {
    if (!this.tools.has(ev.toolCallId)) this.toolInput({ ...ev, input: {} });
    this.tools.get(ev.toolCallId).finish(ev);
  }

  /** The batches as stored (metadata.subagents), in place of the live cards. */
  replaceBatches(batches) {
    this.batches = [];
    this.batchBox.replaceChildren();
    for (const batch of batches) this.addBatch(BatchCard.restore(batch));
  }

  addBatch(card) {
    this.batches.push(card);
    this.batchBox.append(card.el);
    return card;
  }

  batchStart(ev) {
    this.addBatch(new BatchCard(ev));
  }

  /** An update goes to the batch that has the item, else to the newest unfinished batch. */
  subagentUpdate(ev) {
    const open = this.batches.filter((b) => !b.finished);
    const card =
      this.batches.find((b) => b.has(ev.subagent.id)) ?? open.at(-1) ?? this.batches.at(-1) ?? this.addBatch(new BatchCard({}));
    card.update(ev.subagent);
  }

  subagentDone(ev) {
    const open = this.batches.filter((b) => !b.finished);
    const card = open.find((b) => ev.toolCallId && b.toolCallId === ev.toolCallId) ?? open.at(-1);
    card?.done(ev.summary);
  }

  error({ code, message }) {
    this.body.append(h("div", { class: "msg-error", role: "alert" }, code ? `${code}: ${message}` : message));
  }

  finish({ model, usage }) {
    if (!model) return;
    const tokens = usage ? ` · ${usage.inputTokens ?? 0} in / ${usage.outputTokens ?? 0} out tokens` : "";
    this.foot.textContent = `${model}${tokens}`;
  }
}

export class ChatView {
  constructor(root) {
    this.root = root;
    this.byId = new Map(); // assistant message id -> AssistantView
    this.clear();
  }

  clear() {
    this.byId.clear();
    this.root.replaceChildren(h("div", { class: "empty" }, "Send a message to start a conversation."));
  }

  /** Renders a session's saved messages (GET /api/sessions/{id}/messages). */
  renderHistory(messages) {
    this.byId.clear();
    this.root.replaceChildren();
    for (const msg of messages) {
      if (msg.role === "user") this.addUser(msg.content);
      else if (msg.role === "assistant") this.add(AssistantView.restore(msg));
    }
    if (!messages.length) this.clear();
    this.scroll(true);
  }

  addUser(text) {
    this.root.querySelector(".empty")?.remove();
    this.root.append(h("article", { class: "msg user" }, h("div", { class: "msg-body" }, h("div", { class: "content" }, text))));
    this.scroll(true);
  }

  addAssistant(id = null) {
    return this.add(new AssistantView(id));
  }

  add(view) {
    view.around = (render) => this.pinned(render);
    this.root.querySelector(".empty")?.remove();
    this.root.append(view.el);
    if (view.id != null) this.byId.set(String(view.id), view);
    return view;
  }

  /** Gives a provisional view (created before the `start` event) its message id. */
  bind(view, id) {
    view.setId(id);
    this.byId.set(String(id), view);
  }

  assistant(id) {
    return this.byId.get(String(id));
  }

  /** Keeps the newest content in sight unless the reader scrolled up. */
  scroll(force = false) {
    if (force || this.atBottom()) this.root.scrollTop = this.root.scrollHeight;
  }

  atBottom() {
    const el = this.root;
    return el.scrollHeight - el.scrollTop - el.clientHeight < 120;
  }

  /** Runs change(), then scrolls to the bottom if the list was there before it (content grew). */
  pinned(change) {
    const was = this.atBottom();
    change();
    if (was) this.root.scrollTop = this.root.scrollHeight;
  }
}
