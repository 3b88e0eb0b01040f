// The message list. An assistant message is, top to bottom
// (docs/requirements.md#subagent-cards): its subagent batch cards,
// its tool cards, its thinking block, its content (markdown, rendered incrementally at most once per
// animation frame while it streams), how it ended, and its actions. Live turns and restored history
// use the same views.
//
// A chat is a tree: every message names its parent (`parentSequence`); a retry, a regenerate or an
// edit is a new turn whose user message is a sibling of the one it replaces. The list shows one path
// from the root: at every fork the version the reader picked, else the one on the way to the head
// (the newest turn), else the newest. A turn with several versions shows a "‹ 2/2 ›" switcher; the
// last turn offers Retry (failed, cancelled) or Regenerate (completed), and Edit on its message.
// Views are kept by message id, so switching versions or refreshing the tree never renders a message
// again (nor fetches its images again).

import { h } from "./dom.js";
import { errorCode, errorText } from "./errors.js";
import { LiveMarkdown } from "./markdown.js";
import { BatchCard } from "./subagents.js";
import { storedCallState, ToolCard } from "./tools.js";

const SR = (text) => h("span", { class: "visually-hidden" }, text);

export class UserView {
  constructor(text, id = null) {
    this.text = text;
    this.content = h("div", { class: "content" }, text);
    this.actions = h("div", { class: "msg-actions" });
    this.body = h("div", { class: "msg-body" }, SR("You said:"), this.content, this.actions);
    this.el = h("article", { class: "msg user" }, this.body);
    this.setId(id);
  }

  setId(id) {
    this.id = id;
    if (id != null) this.el.dataset.messageId = id;
  }

  static restore(msg) {
    return new UserView(msg.content, msg.id);
  }

  /** Edit (on the last turn): the text in a box; Save sends it as a new version of the turn. */
  setActions({ onEdit = null, onRetry = null } = {}) {
    if (this.editing) return;
    this.actions.replaceChildren(
      onEdit ? h("button", { type: "button", class: "link msg-edit", onclick: () => this.edit(onEdit) }, "Edit") : "",
      onRetry ? h("button", { type: "button", class: "link msg-retry", onclick: () => onRetry() }, "Retry") : "",
    );
  }

  edit(onSave) {
    this.editing = true;
    const box = h("textarea", { class: "msg-edit-box", rows: Math.min(8, this.text.split("\n").length + 1), "aria-label": "Edit your message" });
    box.value = this.text;
    const done = () => {
      this.editing = false;
      this.content.hidden = false;
      form.remove();
      this.actions.hidden = false;
    };
    const form = h(
      "form",
      {
        class: "msg-edit-form",
        onsubmit: (event) => {
          event.preventDefault();
          const text = box.value.trim();
          if (!text) return;
          done();
          onSave(text);
        },
      },
      box,
      h("div", { class: "msg-edit-actions" }, h("button", { type: "submit", class: "primary" }, "Save and send"), h("button", { type: "button", onclick: done }, "Cancel")),
    );
    box.addEventListener("keydown", (event) => {
      if (event.key === "Escape") {
        event.preventDefault();
        done();
      } else if (event.key === "Enter" && !event.shiftKey && !event.isComposing) {
        event.preventDefault();
        form.requestSubmit();
      }
    });
    this.content.hidden = true;
    this.actions.hidden = true;
    this.content.after(form);
    box.focus();
  }
}

export class AssistantView {
  constructor(id = null) {
    this.el = h("article", { class: "msg assistant" });
    this.around = (render) => render(); // the message list sets one that keeps the scroll pinned
    this.status = "pending";
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
    this.errorBox = h("div", { class: "msg-error", role: "alert", hidden: true });
    this.foot = h("div", { class: "msg-foot" });
    this.actions = h("div", { class: "msg-actions" });
    const body = h(
      "div",
      { class: "msg-body" },
      SR("The agent said:"),
      this.batchBox,
      this.toolBox,
      this.thinking,
      this.content,
      this.errorBox,
      this.foot,
      this.actions,
    );
    this.el.replaceChildren(h("div", { class: "avatar", "aria-hidden": "true" }, "A"), body);
    this.body = body;
  }

  /** A saved assistant message, with metadata.subagents and metadata.toolCalls. */
  static restore(msg) {
    const view = new AssistantView(msg.id);
    view.restoreFrom(msg);
    return view;
  }

  restoreFrom(msg) {
    for (const batch of msg.metadata?.subagents ?? []) this.addBatch(BatchCard.restore(batch));
    this.applyCalls(msg);
    if (msg.thinking) this.appendReasoning(msg.thinking);
    this.appendText(msg.content || "");
    this.text.flush();
    this.applyEnd(msg);
  }

  /** The stored tool calls, each in its stored state (a card that is missing is added). */
  applyCalls(msg) {
    for (const call of msg.metadata?.toolCalls ?? []) {
      if (!this.tools.has(call.id)) this.toolInput({ toolCallId: call.id, toolName: call.name, input: call.input });
      const state = storedCallState(call, msg.status);
      if (state !== "running") this.tools.get(call.id).finish(call, state);
    }
  }

  /** How the stored message ended: its error, its model and tokens; running cards end with it. */
  applyEnd(msg) {
    this.status = msg.status;
    if (msg.status === "completed" || msg.status === "pending") this.errorBox.hidden = true;
    if (msg.status === "failed" || msg.status === "cancelled") {
      const error = msg.metadata?.error ?? { code: msg.status === "cancelled" ? "cancelled" : "failed" };
      this.error(msg.status === "cancelled" ? { ...error, code: "cancelled" } : error);
      this.settle(error.code ? error : { code: msg.status });
    }
    if (msg.status !== "pending") this.finish({ model: msg.model, usage: msg.usage });
  }

  /** After a turn: what was stored for it (tool states, batches, error) replaces what the stream said. */
  reconcile(msg) {
    this.applyCalls(msg);
    const batches = msg.metadata?.subagents;
    if (batches?.length) this.replaceBatches(batches);
    this.applyEnd(msg);
  }

  setStreaming(on) {
    this.el.classList.toggle("streaming", on);
    this.streaming = on;
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
    if (this.tools.has(ev.toolCallId)) return;
    const card = new ToolCard(ev);
    this.tools.set(ev.toolCallId, card);
    this.toolBox.append(card.el);
  }

  toolOutput(ev) {
    if (!this.tools.has(ev.toolCallId)) this.toolInput({ ...ev, input: {} });
    this.tools.get(ev.toolCallId).finish(ev);
  }

  /** a2a-task-started: its tool card can open the callee from now on. */
  taskStarted(ev) {
    this.tools.get(ev.toolCallId)?.taskStarted(ev);
  }

  /** The turn ended (`error` or a lost stream): every card still running ends as the turn did. */
  settle(error) {
    for (const card of this.tools.values()) card.settle(error);
  }

  /** The batches as stored (metadata.subagents), in place of the live cards. A card already shown
   * for a batch is brought up to date where it is, so a subagent's text the reader opened stays
   * open when the turn ends; any other batch gets a card made from the record. */
  replaceBatches(batches) {
    const shown = new Set(this.batches);
    this.batches = [];
    this.batchBox.replaceChildren();
    for (const batch of batches) {
      const items = batch.items ?? [];
      const card = [...shown].find(
        (c) => (batch.toolCallId && c.toolCallId === batch.toolCallId) || items.some((item) => c.has(item.id)),
      );
      if (!card) {
        this.addBatch(BatchCard.restore(batch));
        continue;
      }
      shown.delete(card);
      for (const item of items) card.update(item);
      if (batch.summary && !batch.summary.running) card.done(batch.summary);
      this.addBatch(card);
    }
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

  /** How the turn failed, in a sentence for people (the code stays on the element). */
  error(err) {
    const code = errorCode(err);
    this.status = code === "cancelled" ? "cancelled" : "failed";
    this.errorBox.textContent = errorText(err);
    this.errorBox.dataset.code = code;
    this.errorBox.hidden = false;
  }

  finish({ model, usage }) {
    if (!model) return;
    const tokens = usage ? ` · ${usage.inputTokens ?? 0} in / ${usage.outputTokens ?? 0} out tokens` : "";
    this.foot.textContent = `${model}${tokens}`;
  }

  /** The switcher of the turn's versions and, on the last turn, Retry or Regenerate. */
  setActions({ fork = null, onRetry = null } = {}) {
    const again = onRetry && (this.status === "completed" ? "Regenerate" : "Retry");
    this.actions.replaceChildren(
      fork ? switcher(fork) : "",
      again
        ? h("button", { type: "button", class: `link msg-${again.toLowerCase()}`, title: again === "Retry" ? "Send this message again" : "Write a new answer to this message", onclick: () => onRetry() }, again)
        : "",
    );
  }
}

/** "‹ 2/3 ›": fork = {index, count, go(i)}. */
function switcher({ index, count, go }) {
  return h(
    "div",
    { class: "branch", role: "group", "aria-label": "Versions of this turn" },
    h("button", { type: "button", class: "icon branch-prev", "aria-label": "Previous version", disabled: index === 0, onclick: () => go(index - 1) }, "‹"),
    h("span", { class: "branch-pos", "aria-live": "polite" }, `${index + 1}/${count}`),
    h("button", { type: "button", class: "icon branch-next", "aria-label": "Next version", disabled: index === count - 1, onclick: () => go(index + 1) }, "›"),
  );
}

export class ChatView {
  /** hooks: onRetry({user, text}) and onEdit({user, text}) for the last turn (user: the stored message). */
  constructor(root, { onRetry = () => {}, onEdit = () => {} } = {}) {
    Object.assign(this, { root, onRetry, onEdit });
    this.views = new Map(); // message id -> UserView | AssistantView
    this.busy = false;
    this.clear();
  }

  /** An empty, new chat. */
  clear() {
    this.views.clear();
    this.setMessages([], 0);
    this.pending = [];
    this.cut = null;
    this.root.replaceChildren(h("div", { class: "empty" }, "Send a message to start a conversation."));
  }

  /** The state of a chat that does not exist (deleted, or never ours). */
  notFound(onNew) {
    this.clear();
    this.root.replaceChildren(
      h(
        "div",
        { class: "empty not-found", role: "status" },
        h("p", { class: "not-found-title" }, "This chat no longer exists."),
        h("p", { class: "muted" }, "It may have been deleted, or the link is wrong."),
        h("button", { type: "button", class: "primary", onclick: onNew }, "Start a new chat"),
      ),
    );
  }

  /** Every message of the chat (GET .../messages?mode=all) and its head. */
  setMessages(messages, head) {
    this.bySeq = new Map(messages.map((m) => [m.sequence, m]));
    this.children = new Map();
    for (const m of [...messages].sort((a, b) => a.sequence - b.sequence)) {
      const parent = m.parentSequence || 0;
      if (!this.children.has(parent)) this.children.set(parent, []);
      this.children.get(parent).push(m);
    }
    this.head = head || messages.reduce((max, m) => Math.max(max, m.sequence), 0);
    this.choice ??= new Map(); // parent sequence -> the child the reader picked
  }

  /** A chat opened from the history: its messages, shown along the newest path. */
  renderHistory(messages, head) {
    this.views.clear();
    this.choice = new Map();
    this.pending = [];
    this.cut = null;
    this.setMessages(messages, head);
    this.render();
    this.scroll(true);
  }

  /** The path shown: from the root, at each fork the picked child, else the head's, else the newest. */
  path() {
    const onHead = new Set();
    for (let s = this.head; s; s = this.bySeq.get(s)?.parentSequence) {
      if (onHead.has(s)) break;
      onHead.add(s);
    }
    const out = [];
    for (let parent = 0; ; ) {
      if (this.cut != null && parent === this.cut) break;
      const kids = this.children.get(parent) ?? [];
      if (!kids.length) break;
      const picked = this.choice.get(parent);
      const next = kids.find((k) => k.sequence === picked) ?? kids.find((k) => onHead.has(k.sequence)) ?? kids.at(-1);
      out.push(next);
      parent = next.sequence;
      if (out.length > this.bySeq.size) break; // a cycle would be a bug of the store: never loop
    }
    return out;
  }

  /** The last message shown, when it is not the head: where a new message must branch from. */
  branchPoint() {
    const last = this.path().at(-1);
    return last && last.sequence !== this.head ? last.sequence : null;
  }

  viewOf(msg) {
    let view = this.views.get(String(msg.id));
    const stale = view instanceof AssistantView && !view.live && view.status !== msg.status;
    if (!view || stale) {
      view = msg.role === "user" ? UserView.restore(msg) : AssistantView.restore(msg);
      if (view instanceof AssistantView) view.around = (render) => this.pinned(render);
      this.views.set(String(msg.id), view);
    }
    view.sequence = msg.sequence;
    return view;
  }

  /** Shows the path (views reused by id), the live turn after it, and each turn's controls. */
  /** The messages of the path that are shown (user and assistant messages). */
  shownPath() {
    return this.path().filter((m) => m.role === "user" || m.role === "assistant");
  }

  render() {
    // A live turn's views belong to the path once the stored tree has their messages.
    const stored = new Set([...this.bySeq.values()].map((m) => String(m.id)));
    this.pending = this.pending.filter((v) => v.id == null || !stored.has(String(v.id)));
    if (!this.pending.length) this.cut = null;
    const path = this.shownPath();
    const shown = path.map((m) => this.viewOf(m));
    const els = [...shown, ...this.pending].map((v) => v.el);
    this.pinned(() => {
      if (!els.length) {
        this.root.replaceChildren(h("div", { class: "empty" }, "Send a message to start a conversation."));
        return;
      }
      // Moved, not rebuilt: a message keeps its element (and its images, its open details).
      els.forEach((el, i) => {
        if (this.root.children[i] !== el) this.root.insertBefore(el, this.root.children[i] ?? null);
      });
      while (this.root.children.length > els.length) this.root.lastElementChild.remove();
    });
    this.controls(path);
  }

  controls(path) {
    const lastUser = path.findLastIndex((m) => m.role === "user");
    for (const [i, msg] of path.entries()) {
      const view = this.viewOf(msg);
      if (msg.role === "user") {
        const last = i === lastUser && !this.busy && !this.pending.length;
        const answered = path[i + 1]?.role === "assistant";
        view.setActions({
          onEdit: last ? (text) => this.onEdit({ user: msg, text }) : null,
          onRetry: last && !answered ? () => this.onRetry({ user: msg, text: msg.content }) : null,
        });
        if (!answered) continue;
      } else {
        const user = path[i - 1]?.role === "user" ? path[i - 1] : null;
        const last = user && i - 1 === lastUser && !this.busy && !this.pending.length && msg.status !== "pending";
        view.setActions({
          fork: this.busy ? null : (this.fork(user) ?? this.fork(msg)),
          onRetry: last ? () => this.onRetry({ user, text: user.content }) : null,
        });
      }
    }
  }

  /** The versions of a message (its siblings of its role), when it has several. */
  fork(msg) {
    if (!msg) return null;
    const parent = msg.parentSequence || 0;
    const versions = (this.children.get(parent) ?? []).filter((m) => m.role === msg.role);
    if (versions.length < 2) return null;
    return {
      index: versions.indexOf(msg),
      count: versions.length,
      go: (i) => {
        this.choice.set(parent, versions[i].sequence);
        this.render();
      },
    };
  }

  /** A new turn's views, shown at once (before the server knows its ids). With `replacing` (a stored
   * user message), the turn is a new version of that one: the path is shown up to its parent. */
  beginTurn(text, replacing = null) {
    this.before = this.choice; // given back if the turn does not begin
    this.choice = new Map(); // the new turn becomes the head: the path follows it
    this.cut = replacing ? replacing.parentSequence || 0 : null;
    const user = new UserView(text);
    const assistant = new AssistantView();
    assistant.around = (render) => this.pinned(render);
    assistant.live = true;
    this.pending = [user, assistant];
    this.render();
    this.scroll(true);
    return { user, assistant };
  }

  /** A turn whose request failed before it began: its views go, the path is as before. */
  dropTurn() {
    if (this.before) this.choice = this.before;
    this.pending = [];
    this.cut = null;
    this.render();
  }

  /** Gives a view created before the `start` event its message id. */
  bind(view, id) {
    view.setId(id);
    this.views.set(String(id), view);
  }

  /** A view for a running turn found in the history (a resumed turn) or a new one. */
  liveAssistant(id) {
    let view = this.views.get(String(id));
    if (!(view instanceof AssistantView)) {
      view = new AssistantView(id);
      view.around = (render) => this.pinned(render);
      this.views.set(String(id), view);
      this.pending.push(view);
      this.render();
    }
    view.live = true;
    return view;
  }

  assistant(id) {
    const view = this.views.get(String(id));
    return view instanceof AssistantView ? view : undefined;
  }

  setBusy(busy) {
    this.busy = busy;
    this.root.setAttribute("aria-busy", String(busy));
    this.controls(this.shownPath());
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
