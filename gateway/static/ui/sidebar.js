// The sidebar: the caller's chat sessions (newest first), delete buttons, and the agent picker.

import { api, json } from "./api.js";
import { h } from "./dom.js";

const AGENT = "agentmesh.agent";

export class Sidebar {
  /** hooks: onOpen(session), onDeleted(id). */
  constructor({ list, agentSelect, onOpen, onDeleted }) {
    Object.assign(this, { list, agentSelect, onOpen, onDeleted });
    this.sessions = [];
    this.activeId = null;
    agentSelect.addEventListener("change", () => localStorage.setItem(AGENT, agentSelect.value));
  }

  get agent() {
    return this.agentSelect.value;
  }

  set agent(slug) {
    if ([...this.agentSelect.options].some((o) => o.value === slug)) this.agentSelect.value = slug;
  }

  async loadAgents() {
    const { agents } = await json("/api/agents");
    this.agentSelect.replaceChildren(...agents.map((a) => h("option", { value: a.slug }, a.name || a.slug)));
    this.agent = localStorage.getItem(AGENT) || "";
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
    if (!this.sessions.length) {
      this.list.replaceChildren(h("li", { class: "muted none" }, "No conversations yet"));
      return;
    }
    this.list.replaceChildren(...this.sessions.map((s) => this.item(s)));
  }

  item(s) {
    return h(
      "li",
      { class: s.id === this.activeId ? "session active" : "session", dataset: { sessionId: s.id } },
      h(
        "button",
        { type: "button", class: "session-open", title: s.title, onclick: () => this.onOpen(s) },
        h("span", { class: "session-title" }, s.title || "Untitled"),
        h("span", { class: "session-agent" }, s.agent),
      ),
      h("button", {
        type: "button",
        class: "session-delete icon",
        title: "Delete this conversation",
        "aria-label": `Delete ${s.title || "conversation"}`,
        onclick: () => this.remove(s.id),
      }, "×"),
    );
  }

  async remove(id) {
    await api(`/api/sessions/${encodeURIComponent(id)}`, { method: "DELETE" });
    this.sessions = this.sessions.filter((s) => s.id !== id);
    this.render();
    this.onDeleted(id);
  }
}
