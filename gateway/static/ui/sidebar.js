// The sidebar: the caller's chat sessions (newest first) with when each was last active, rename
// (inline, PATCH /api/sessions/{id}) and delete buttons, and the agent picker.

import { api, json } from "./api.js";
import { h } from "./dom.js";
import { ago, fullDate } from "./time.js";

const AGENT = "agentmesh.agent";
// The agent a browser starts on until the user picks another: the README's demo agent (the General
// Assistant of services/trace/demo_catalog.yaml); without one, the first agent of the picker.
const DEFAULT_AGENT = "general";

export class Sidebar {
  /** hooks: onOpen(session), onDeleted(id), onRenamed(session). */
  constructor({ list, agentSelect, onOpen, onDeleted, onRenamed = () => {} }) {
    Object.assign(this, { list, agentSelect, onOpen, onDeleted, onRenamed });
    this.sessions = [];
    this.activeId = null;
    this.editing = null; // {id, input, saving, done} while a title is being edited
    this.errors = new Map(); // session id -> the message of its failed rename (shown until the next try)
    agentSelect.addEventListener("change", () => localStorage.setItem(AGENT, agentSelect.value));
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
    const { sessions } = await json("/api/sessions?page_size=100");
    this.sessions = sessions;
    this.render();
  }

  session(id) {
    return this.sessions.find((s) => s.id === id);
  }

  setActive(id) {
    this.activeId = id;
    this.render();
  }

  render() {
    if (this.editing) return; // rebuilding the list would take the input away; finishEdit() renders
    if (!this.sessions.length) {
      this.list.replaceChildren(h("li", { class: "muted none" }, "No conversations yet"));
      return;
    }
    this.list.replaceChildren(...this.sessions.map((s) => this.item(s)));
  }

  item(s) {
    const error = this.errors.get(s.id);
    return h(
      "li",
      { class: s.id === this.activeId ? "session active" : "session", dataset: { sessionId: s.id } },
      h(
        "div",
        { class: "session-row" },
        h(
          "button",
          { type: "button", class: "session-open", title: s.title, onclick: () => this.onOpen(s) },
          h("span", { class: "session-title" }, s.title || "Untitled"),
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
          title: "Rename this conversation",
          "aria-label": `Rename ${s.title || "conversation"}`,
          onclick: (event) => this.edit(s, event.currentTarget.closest("li")),
        }, "✎"),
        h("button", {
          type: "button",
          class: "session-delete icon",
          title: "Delete this conversation",
          "aria-label": `Delete ${s.title || "conversation"}`,
          onclick: () => this.remove(s.id),
        }, "×"),
      ),
      error && h("div", { class: "session-error", role: "alert" }, `Rename failed: ${error}`),
    );
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
      "aria-label": "Conversation title",
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
      const res = await api(`/api/sessions/${encodeURIComponent(s.id)}`, { method: "PATCH", body: { title } });
      const body = await res.json().catch(() => null);
      const saved = body?.session ?? body;
      const current = this.session(s.id) ?? s;
      Object.assign(current, saved?.id === s.id ? saved : {}, { title: saved?.title || title });
      this.finishEdit(editing);
      this.onRenamed(current);
    } catch (err) {
      this.errors.set(s.id, err.message);
      this.finishEdit(editing);
    }
  }

  finishEdit(editing) {
    if (editing.done) return;
    editing.done = true;
    if (this.editing === editing) this.editing = null;
    this.render();
  }

  async remove(id) {
    await api(`/api/sessions/${encodeURIComponent(id)}`, { method: "DELETE" });
    this.sessions = this.sessions.filter((s) => s.id !== id);
    this.render();
    this.onDeleted(id);
  }
}
