// The agents page: the caller's agents and the built-in ones (read-only: clone one to change it), and an
// editor with sections for the prompt and model, tools, limits, agent-invoke and subagents, whose
// choices come from GET /api/agents/options. A save names the version it was made against (If-Match);
// a change made elsewhere meanwhile is refused (412) and shown, never overwritten.

import { api, json } from "./api.js";
import { h } from "./dom.js";

const ROLE_LABEL = { supervisor: "chat", subagent: "subagent", "a2a-callee": "agent-invoke callee" };
const LIMITS = [
  ["maxSteps", "Model steps per run"],
  ["maxOutputTokens", "Output tokens per step"],
  ["timeoutMs", "Run deadline (ms)"],
];
const INVOKE = [
  ["maxRecursionDepth", "Nesting depth"],
  ["timeoutMs", "Callee deadline (ms)"],
  ["maxOutputTokens", "Callee output tokens"],
  ["maxParallel", "Inputs run in parallel"],
];

const enc = encodeURIComponent;

export class AgentsPage {
  /** hooks: onChanged() after any write (the chat's agent picker reloads), onChat(slug). */
  constructor({ root, onChanged = () => {}, onChat = () => {} }) {
    Object.assign(this, { root, onChanged, onChat });
    this.options = null;
    this.agents = [];
    this.selected = null; // the agent shown in the editor (null: a new one)
    this.list = h("nav", { class: "agents-list", "aria-label": "Agents" });
    this.editor = h("div", { class: "agent-editor" });
    root.replaceChildren(
      h(
        "header",
        { class: "agents-header" },
        h("h1", {}, "Agents"),
        h("button", { type: "button", id: "agent-new", class: "primary", onclick: () => this.edit(null) }, "+ New agent"),
      ),
      h("div", { class: "agents-body" }, this.list, this.editor),
    );
  }

  /** Loads the options and the agents, and shows `slug` (or the first of the user's own). */
  async open(slug = null) {
    // Nothing of a previous visit stays clickable while the current state loads.
    this.list.replaceChildren();
    this.editor.replaceChildren(h("p", { class: "muted" }, "Loading…"));
    this.options = await json("/api/agents/options");
    await this.reload();
    const pick = this.agents.find((a) => a.slug === slug) ?? this.agents.find((a) => a.owner) ?? null;
    if (pick) this.edit(pick);
    else this.edit(null);
  }

  async reload() {
    this.agents = (await json("/api/agents")).agents;
    this.renderList();
  }

  renderList() {
    const item = (a) =>
      h(
        "li",
        { class: a.slug === this.selected?.slug && a.owner === this.selected?.owner ? "agent-item active" : "agent-item", dataset: { slug: a.slug } },
        h(
          "button",
          { type: "button", class: "agent-open", onclick: () => this.edit(a) },
          h("span", { class: "agent-item-name" }, a.name || a.slug),
          h("span", { class: "agent-item-meta" }, a.slug, a.owner ? ` · v${a.version}` : ""),
        ),
      );
    const own = this.agents.filter((a) => a.owner);
    const builtin = this.agents.filter((a) => !a.owner);
    this.list.replaceChildren(
      h("h3", {}, "Your agents"),
      h("ul", { id: "own-agents" }, own.length ? own.map(item) : h("li", { class: "muted none" }, "None yet: create one or clone a built-in")),
      h("h3", {}, "Built-in"),
      h("ul", { id: "builtin-agents" }, builtin.map(item)),
    );
  }

  /** Shows `agent` in the editor (null: a new agent from the defaults). */
  edit(agent) {
    this.selected = agent;
    this.renderList();
    history.replaceState(null, "", agent ? `#/agents/${enc(agent.slug)}` : "#/agents");
    const o = this.options;
    const a = agent ?? { ...o.defaults, slug: "", name: "", tools: [], version: 0, owner: "" };
    const readOnly = Boolean(agent && !agent.owner);
    const effective = a.effectiveSubagentConfig ?? o.defaults.effectiveSubagentConfig;
    const mesh = o.defaults.effectiveSubagentConfig; // what an agent inherits
    const sub = a.subagentConfig ?? {};
    const number = (path, value, { optional = false, placeholder = "" } = {}) => {
      const range = o.ranges.find((r) => r.field === path);
      return h("input", {
        type: "number",
        class: "num",
        name: path,
        "data-path": path,
        min: range?.min,
        max: range?.max,
        value: value ?? "",
        placeholder,
        "data-optional": optional,
      });
    };
    const row = (label, control, hint = "") =>
      h("label", { class: "field" }, h("span", { class: "field-label" }, label), control, hint && h("span", { class: "hint" }, hint));
    const check = (name, value, checked, label, extra = {}) =>
      h("label", { class: "check" }, h("input", { type: "checkbox", name, value, checked, ...extra }), label);
    const choices = (name, list, selected) =>
      h(
        "div",
        { class: "checks", "data-choices": name },
        list.map((c) => check(name, c.slug, selected.includes(c.slug), h("span", {}, c.name, " ", h("code", {}, c.slug), c.owner || c.slug === "*" ? "" : h("span", { class: "badge" }, "built-in")))),
      );
    const modes = (name, any, label, body) =>
      h(
        "div",
        { class: "mode" },
        h("label", { class: "check" }, h("input", { type: "radio", name, value: "any", checked: any }), label),
        h("label", { class: "check" }, h("input", { type: "radio", name, value: "only", checked: !any }), "Only these:"),
        body,
      );
    const subTools = o.tools.filter((t) => t.roles.includes("subagent"));
    const form = h(
      "form",
      { id: "agent-form", class: "agent-form", novalidate: true, onsubmit: (e) => (e.preventDefault(), this.save(form)) },
      h(
        "div",
        { class: "agent-form-head" },
        h("h3", { id: "agent-title" }, agent ? a.name : "New agent"),
        agent && h("span", { class: "badge", id: "agent-version" }, readOnly ? "built-in" : `version ${a.version}`),
      ),
      readOnly &&
        h(
          "p",
          { class: "notice", id: "agent-readonly" },
          "Built-in agents are read-only. Clone this one to change it: the copy is yours.",
        ),
      h(
        "fieldset",
        { disabled: readOnly },
        h("legend", {}, "Prompt and model"),
        h(
          "div",
          { class: "grid2" },
          row("Slug", h("input", { id: "agent-slug", name: "slug", value: a.slug, readonly: Boolean(agent), required: true, placeholder: "my-agent", spellcheck: "false" })),
          row("Name", h("input", { id: "agent-name", name: "name", value: a.name, required: true, placeholder: "My agent" })),
          row("Model", h("input", { id: "agent-model", name: "model", value: a.model })),
          row("Description", h("input", { id: "agent-description", name: "description", value: a.description ?? "" })),
        ),
        row("System prompt", h("textarea", { id: "agent-prompt", name: "systemPrompt", rows: 6 }, a.systemPrompt)),
      ),
      h(
        "fieldset",
        { disabled: readOnly },
        h("legend", {}, "Tools"),
        h(
          "div",
          { class: "checks", "data-choices": "tools" },
          o.tools.map((t) =>
            check(
              "tools",
              t.name,
              a.tools.includes(t.name),
              h(
                "span",
                { class: "tool-choice" },
                h("code", {}, t.name),
                " ",
                t.roles.map((r) => h("span", { class: "badge role" }, ROLE_LABEL[r] ?? r)),
                h("span", { class: "hint" }, t.description),
              ),
            ),
          ),
        ),
      ),
      h(
        "fieldset",
        { disabled: readOnly },
        h("legend", {}, "Limits"),
        h("div", { class: "grid3" }, LIMITS.map(([key, label]) => row(label, number(`limits.${key}`, a.limits?.[key])))),
      ),
      h(
        "fieldset",
        { disabled: readOnly },
        h("legend", {}, "Agent-invoke"),
        h("div", { class: "field-label" }, "Agents it may call"),
        choices("callees", o.callees, a.invoke?.allowedCallees ?? []),
        h("div", { class: "grid4" }, INVOKE.map(([key, label]) => row(label, number(`invoke.${key}`, a.invoke?.[key])))),
      ),
      h(
        "fieldset",
        { disabled: readOnly },
        h("legend", {}, "Subagents"),
        h(
          "div",
          { class: "grid3" },
          row(
            "Delegation",
            h(
              "select",
              { id: "sub-enabled", name: "sub-enabled" },
              h("option", { value: "", selected: sub.enabled === undefined }, `Mesh default (${mesh.enabled ? "on" : "off"})`),
              h("option", { value: "on", selected: sub.enabled === true }, "On"),
              h("option", { value: "off", selected: sub.enabled === false }, "Off"),
            ),
          ),
          row("At once", number("subagentConfig.maxConcurrent", sub.maxConcurrent, { optional: true, placeholder: `default ${mesh.maxConcurrent}` })),
          row("Deadline (ms)", number("subagentConfig.timeoutMs", sub.timeoutMs, { optional: true, placeholder: `default ${mesh.timeoutMs}` })),
        ),
        h("div", { class: "field-label" }, "Preset agents a delegate call may name"),
        modes("preset-mode", !sub.allowedPresetAgentIds, "Any agent", choices("presets", o.presetAgents, sub.allowedPresetAgentIds ?? [])),
        h("div", { class: "field-label" }, "Tools a subagent may get"),
        modes(
          "subtool-mode",
          !sub.allowedToolNames,
          "Its agent's own tools",
          h(
            "div",
            { class: "checks", "data-choices": "subtools" },
            subTools.map((t) => check("subtools", t.name, (sub.allowedToolNames ?? []).includes(t.name), h("code", {}, t.name))),
          ),
        ),
        h(
          "p",
          { class: "hint" },
          `Never given to a subagent: ${o.blockedToolNames.join(", ")}. In force now: `,
          h("span", { id: "sub-effective" }, effectiveText(effective)),
        ),
      ),
      h("p", { id: "agent-error", class: "form-error", role: "alert", hidden: true }),
      h(
        "div",
        { class: "agent-actions" },
        !readOnly && h("button", { type: "submit", id: "agent-save", class: "primary" }, agent ? "Save" : "Create"),
        agent && h("button", { type: "button", id: "agent-clone", onclick: () => this.clone(agent) }, "Clone"),
        agent && h("button", { type: "button", id: "agent-chat", onclick: () => this.onChat(agent.slug) }, "Chat with it"),
        agent && !readOnly && h("button", { type: "button", id: "agent-delete", class: "danger", onclick: () => this.remove(agent) }, "Delete"),
        h("span", { id: "agent-status", class: "muted", role: "status" }),
      ),
    );
    this.editor.replaceChildren(form);
  }

  /** The agent as the form says (every field it controls; a cleared optional number is `null`). */
  body(form) {
    const value = (name) => form.elements[name].value;
    const checked = (name) => [...form.querySelectorAll(`input[name="${name}"]:checked`)].map((i) => i.value);
    const mode = (name) => form.querySelector(`input[name="${name}"]:checked`)?.value;
    const numbers = (prefix) => {
      const out = {};
      for (const input of form.querySelectorAll(`input[data-path^="${prefix}."]`)) {
        const key = input.dataset.path.slice(prefix.length + 1);
        if (input.value === "") {
          if (input.dataset.optional === "true") out[key] = null;
          continue; // a required one left empty keeps its value (or its default)
        }
        out[key] = Number(input.value);
      }
      return out;
    };
    const enabled = value("sub-enabled");
    return {
      slug: value("slug").trim(),
      name: value("name").trim(),
      description: value("description"),
      model: value("model").trim(),
      systemPrompt: value("systemPrompt"),
      tools: checked("tools"),
      limits: numbers("limits"),
      invoke: { ...numbers("invoke"), allowedCallees: checked("callees") },
      subagentConfig: {
        enabled: enabled === "" ? null : enabled === "on",
        ...numbers("subagentConfig"),
        allowedPresetAgentIds: mode("preset-mode") === "any" ? null : checked("presets"),
        allowedToolNames: mode("subtool-mode") === "any" ? null : checked("subtools"),
      },
    };
  }

  async save(form) {
    const agent = this.selected;
    const body = this.body(form);
    this.status("Saving…");
    try {
      const res = agent
        ? await api(`/api/agents/${enc(agent.slug)}`, { method: "PATCH", body, headers: { "If-Match": `"${agent.version}"` } })
        : await api("/api/agents", { method: "POST", body });
      const saved = (await res.json()).agent;
      await this.reload();
      this.edit(this.agents.find((a) => a.slug === saved.slug && a.owner) ?? saved);
      this.status(`Saved · version ${saved.version}`);
      this.onChanged();
    } catch (err) {
      this.fail(err, agent);
    }
  }

  async clone(agent) {
    try {
      const res = await api(`/api/agents/${enc(agent.slug)}/clone`, { method: "POST" });
      const copy = (await res.json()).agent;
      await this.reload();
      this.edit(this.agents.find((a) => a.slug === copy.slug && a.owner) ?? copy);
      this.status(`Cloned from ${agent.slug}`);
      this.onChanged();
    } catch (err) {
      this.fail(err, agent);
    }
  }

  async remove(agent) {
    if (!confirm(`Delete the agent "${agent.name}"? A turn already running with it finishes; its chats stay.`)) return;
    try {
      await api(`/api/agents/${enc(agent.slug)}`, { method: "DELETE", headers: { "If-Match": `"${agent.version}"` } });
      await this.reload();
      const next = this.agents.find((a) => a.owner) ?? null;
      this.edit(next);
      this.status(`Deleted ${agent.slug}`);
      this.onChanged();
    } catch (err) {
      this.fail(err, agent);
    }
  }

  status(text) {
    const el = this.editor.querySelector("#agent-status");
    if (el) el.textContent = text;
  }

  /** Shows the gateway's message; a stale write (412) offers to load the agent as it is now. */
  fail(err, agent) {
    this.status("");
    const box = this.editor.querySelector("#agent-error");
    if (!box) return;
    box.hidden = false;
    box.replaceChildren(err.message);
    if (err.status === 412 && agent) {
      box.prepend("Changed elsewhere since you opened it: ");
      box.append(
        " ",
        h(
          "button",
          {
            type: "button",
            id: "agent-reload",
            onclick: async () => {
              await this.reload();
              this.edit(this.agents.find((a) => a.slug === agent.slug && a.owner) ?? null);
            },
          },
          "Load the current version",
        ),
      );
    }
  }
}

function effectiveText(e) {
  if (!e.enabled) return "delegation off.";
  const presets = e.allowedPresetAgentIds ? e.allowedPresetAgentIds.join(", ") || "none" : "any agent";
  const tools = e.allowedToolNames ? e.allowedToolNames.join(", ") || "none" : "their own tools";
  return `on, ${e.maxConcurrent} at once, ${e.timeoutMs} ms each, presets: ${presets}, tools: ${tools}.`;
}
