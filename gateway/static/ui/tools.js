// A compact tool card: name, a one-line preview of the input, a status; input and output on expand.

import { h, preview, pretty } from "./dom.js";

export class ToolCard {
  constructor({ toolCallId, toolName, input }) {
    this.status = h("span", { class: "badge", dataset: { status: "running" } }, "running");
    this.output = h("pre", { class: "tool-output" });
    this.el = h(
      "details",
      { class: "tool", dataset: { toolCallId, tool: toolName } },
      h(
        "summary",
        {},
        h("span", { class: "tool-name" }, toolName),
        h("span", { class: "tool-arg" }, summarize(toolName, input)),
        this.status,
      ),
      h("div", { class: "tool-label" }, "Input"),
      h("pre", {}, pretty(input ?? {})),
      h("div", { class: "tool-label" }, "Output"),
      this.output,
    );
  }

  /** The call finished: {ok, output}. */
  finish({ ok, output }) {
    const status = ok ? "ok" : "failed";
    this.status.textContent = status;
    this.status.dataset.status = status;
    this.output.textContent = pretty(output ?? "");
  }
}

function summarize(name, input) {
  if (name === "agent-invoke" && input?.agentSlug) return `→ ${input.agentSlug}: ${preview(input.input, 60)}`;
  if (name === "delegate_parallel" && Array.isArray(input?.tasks)) return `${input.tasks.length} subtasks`;
  if (name === "delegate_task" && input?.goal) return preview(input.goal, 60);
  return preview(input ?? "", 60);
}
