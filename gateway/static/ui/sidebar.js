// The sidebar: the caller's chats (newest first) with when each was last active, a search over their
// titles and contents, rename (inline, PATCH /api/sessions/{id}) and delete buttons (reachable by
// keyboard on every chat; the page confirms a delete), and the agent picker.
//
// Search: titles match at once; contents are read from each chat's messages the first time a search
// needs them (a few chats at a time) and kept while the chat does not change.

import { api, json } from "./api.js";
import { h } from "./dom.js";
import { errorText } from "./errors.js";
import { ago, fullDate } from "./time.js";

const AGENT = "agentmesh.agent";
const enc = encodeURIComponent;
// The agent a browser starts on until the user picks another: the README's demo agent (the General
// Assistant of services/trace/demo_catalog.yaml); without one, the first agent of the picker.
const DEFAULT_AGENT = "general";

export class Sidebar {
  /** hooks: onOpen(session), onDelete(session), onRenamed(session), onChange() after the list changed. */
  constructor({ list, agentSelect, search, status, onOpen, onDelete, onRenamed = () => {}, onChange = () => {} }) {
    Object.assign(this, { list, agentSelect, search, status, onOpen, onDelete, onRenamed, onChange });
    this.sessions = [];
    this.activeId = null;
    this.editing = null; // {id, input, saving, done} while a title is being edited
    this.errors = new Map(); // session id -> the message of its failed rename (shown until the next try)
    this.texts = new Map(); // session id -> {updateTime, text}: the contents search reads
    this.query = "";
    this.searching = 0;
    agentSelect.addEventListener("change", () => localStorage.setItem(AGENT, agentSelect.value));
    search?.addEventListener("input", () => this.find(search.value));
    search?.addEventListener("keydown", (event) => {
      if (event.key === "Escape" && search.value) {
        event.preventDefault();
        search.value = "";
        this.find("");
      }
    });
    setInterval(() => this.refreshTimes(), 60_000);
  }

  get agent() {
    return this.agentSelect.value;
  }

  set agent(slug) {
    if ([...this.agentSelect.options].some((o) => o.value === slug)) this.agentSelect.value = slug;
  }

  /** The picker: the caller's own agents (GET /api/agents, owner set), then the built-in ones. */
  async loadAgents() {
    const { agents } = await json("/api/agents");
    const option = (a) => h("option", { value: a.slug }, a.name || a.slug);
    const own = agents.filter((a) => a.owner);
    const builtin = agents.filter((a) => !a.owner);
    const groups = [h("optgroup", { label: own.length ? "Built-in" : "Agents" }, builtin.map(option))];
    if (own.length) groups.unshift(h("optgroup", { label: "Your agents" }, own.map(option)));
    this.agentSelect.replaceChildren(...groups);
    this.agent = DEFAULT_AGENT;
    this.agent = localStorage.getItem(AGENT) || DEFAULT_AGENT; // a stored pick that is gone keeps the default
  }

  async loadSessions() {
    const load = (this.loads = (this.loads ?? 0) + 1);
    const { sessions } = await json("/api/sessions?page_size=100");
    if (load !== this.loads) return; // a later load (or a delete) answers for the list
    this.sessions = sessions.filter((s) => !this.dropped?.has(s.id)); // a list asked before a delete
    this.render();
    if (this.query) this.find(this.query);
  }

  session(id) {
    return this.sessions.find((s) => s.id === id);
  }

  setActive(id) {
    this.activeId = id;
    this.render();
  }

  /** Takes a chat off the list (deleted). */
  drop(id) {
    (this.dropped ??= new Set()).add(id);
    this.sessions = this.sessions.filter((s) => s.id !== id);
    this.texts.delete(id);
    this.render();
  }

  /** The chats the search keeps: every chat when there is no query. */
  matches() {
    const q = this.query.toLowerCase();
    if (!q) return this.sessions;
    return this.sessions.filter((s) => (s.title || "").toLowerCase().includes(q) || this.textOf(s).toLowerCase().includes(q));
  }

  textOf(s) {
    const known = this.texts.get(s.id);
    return known && known.updateTime === s.updateTime ? known.text : "";
  }

  /** Filters by title at once, then by contents as they are read. */
  async find(query) {
    this.query = query.trim();
    this.render();
    if (!this.query) return;
    const token = ++this.searching;
    const missing = this.sessions.filter((s) => this.texts.get(s.id)?.updateTime !== s.updateTime);
    if (!missing.length) return;
    this.setStatus("Searching…");
    const queue = [...missing];
    const worker = async () => {
      for (let s; (s = queue.shift()); ) {
        try {
          const { messages } = await json(`/api/sessions/${enc(s.id)}/messages?mode=all&limit=1000`);
          this.texts.set(s.id, { updateTime: s.updateTime, text: messages.map((m) => m.content || "").join("\n") });
        } catch {
          this.texts.set(s.id, { updateTime: s.updateTime, text: "" });
        }
      }
    };
    await Promise.all([worker(), worker(), worker()]);
    if (token === this.searching) this.render();
  }

  setStatus(text) {
    if (this.status) this.status.textContent = text;
  }

  render() {
    if (this.editing) return; // rebuilding the list would take the input away; finishEdit() renders
    const shown = this.matches();
    if (this.query) {
      this.setStatus(shown.length ? `${shown.length} chat${shown.length > 1 ? "s" : ""} found` : "No chat matches your search");
    } else this.setStatus("");
    if (!this.sessions.length) this.list.replaceChildren(h("li", { class: "muted none" }, "No conversations yet"));
    else if (!shown.length) this.list.replaceChildren(h("li", { class: "muted none" }, "No chat matches"));
    else this.list.replaceChildren(...shown.map((s) => this.item(s)));
    this.onChange();
  }

  item(s) {
    const error = this.errors.get(s.id);
    const title = s.title || "Untitled";
    const snippet = this.query && !title.toLowerCase().includes(this.query.toLowerCase()) ? this.snippet(s) : "";
    return h(
      "li",
      { class: s.id === this.activeId ? "session active" : "session", dataset: { sessionId: s.id } },
      h(
        "div",
        { class: "session-row" },
        h(
          "button",
          {
            type: "button",
            class: "session-open",
            title: s.title,
            "aria-current": s.id === this.activeId ? "page" : null,
            onclick: () => this.onOpen(s),
          },
          h("span", { class: "session-title" }, title),
          snippet && h("span", { class: "session-snippet" }, snippet),
          h(
            "span",
            { class: "session-meta" },
            h("span", { class: "session-agent" }, s.agent),
            s.updateTime &&
              h("time", { class: "session-time", datetime: s.updateTime, title: fullDate(s.updateTime) }, ago(s.updateTime)),
          ),
        ),
        h("button", {
          type: "button",
          class: "session-rename icon",
          title: "Rename this chat",
          "aria-label": `Rename ${title}`,
          onclick: (event) => this.edit(s, event.currentTarget.closest("li")),
        }, "✎"),
        h("button", {
          type: "button",
          class: "session-delete icon",
          title: "Delete this chat",
          "aria-label": `Delete ${title}`,
          onclick: () => this.onDelete(s),
        }, "×"),
      ),
      error && h("div", { class: "session-error", role: "alert" }, `Rename failed: ${error}`),
    );
  }

  /** The words around the first match in the chat's contents. */
  snippet(s) {
    const text = this.textOf(s).replace(/\s+/g, " ");
    const at = text.toLowerCase().indexOf(this.query.toLowerCase());
    if (at < 0) return "";
    const from = Math.max(0, at - 24);
    return `${from ? "…" : ""}${text.slice(from, at + this.query.length + 40)}…`;
  }

  /** Re-labels the "5 min. ago" times without rebuilding the list. */
  refreshTimes() {
    for (const el of this.list.querySelectorAll("time.session-time")) el.textContent = ago(el.dateTime);
  }

  /** Turns the item's title into an input: Enter or leaving it saves, Escape cancels. */
  edit(s, li) {
    if (this.editing) return;
    this.errors.delete(s.id);
    li.querySelector(".session-error")?.remove();
    const input = h("input", {
      type: "text",
      class: "session-edit",
      value: s.title || "",
      "aria-label": "Chat title",
    });
    const editing = (this.editing = { id: s.id, input, saving: false, done: false });
    input.addEventListener("keydown", (event) => {
      if (event.key === "Enter" && !event.isComposing) {
        event.preventDefault();
        this.save(s, editing);
      } else if (event.key === "Escape") {
        event.preventDefault();
        this.finishEdit(editing);
      }
    });
    input.addEventListener("blur", () => this.save(s, editing));
    li.querySelector(".session-row").replaceChildren(input);
    input.focus();
    input.select();
  }

  /** PATCH /api/sessions/{id} {title}; an error answer keeps the old title and is shown under it. */
  async save(s, editing) {
    if (editing.done || editing.saving) return;
    const title = editing.input.value.trim();
    if (!title || title === s.title) return this.finishEdit(editing);
    editing.saving = true;
    editing.input.readOnly = true;
    try {
      const res = await api(`/api/sessions/${enc(s.id)}`, { method: "PATCH", body: { title } });
      const body = await res.json().catch(() => null);
      const saved = body?.session ?? body;
      const current = this.session(s.id) ?? s;
      Object.assign(current, saved?.id === s.id ? saved : {}, { title: saved?.title || title });
      this.finishEdit(editing);
      this.onRenamed(current);
    } catch (err) {
      this.errors.set(s.id, err.status >= 500 || !err.status ? errorText(err) : err.message);
      this.finishEdit(editing);
    }
  }

  finishEdit(editing) {
    if (editing.done) return;
    editing.done = true;
    const hadFocus = editing.input === document.activeElement;
    if (this.editing === editing) this.editing = null;
    this.render();
    // Keyboard users stay where they were: on the chat's rename button.
    if (hadFocus) this.list.querySelector(`[data-session-id="${CSS.escape(editing.id)}"] .session-rename`)?.focus();
  }
}
