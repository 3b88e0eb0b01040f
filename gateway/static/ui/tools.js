// A compact tool card: name, a one-line preview of the input, a status; input and output on expand.
// A finished agent-invoke card offers to open each callee's trace read-only in the side panel (the
// card sends an `open-trace` event that bubbles up to the page, which hands it to the panel).

import { h, preview, pretty } from "./dom.js";

export class ToolCard {
  constructor({ toolCallId, toolName, input }) {
    this.input = input;
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
    if (this.el.dataset.tool === "agent-invoke") this.offerTraces(output);
  }

  /** One "open" button per callee that ran (a task id and a trace id in the output). */
  offerTraces(output) {
    const runs = Array.isArray(output?.results) ? output.results : [output];
    const slug = this.input?.agentSlug || this.input?.agentUrl || "agent";
    for (const [i, run] of runs.entries()) {
      if (!run?.traceId || !run?.taskId) continue;
      const label = runs.length > 1 ? `open ${i + 1}` : "open";
      // A remote callee's traceId names its home (agent://host/id); our copy of the exchange is local.
      const detail = { name: slug, traceId: run.localTraceId || run.traceId, streamUrl: `/api/agents/a2a/stream?taskId=${encodeURIComponent(run.taskId)}` };
      const open = (event) => {
        event.preventDefault(); // a button inside <summary> must not fold the card
        this.el.dispatchEvent(new CustomEvent("open-trace", { bubbles: true, detail }));
      };
      this.status.before(h("button", { type: "button", class: "link open-trace", title: "Open the callee's trace", onclick: open }, label));
    }
  }
}

function summarize(name, input) {
  if (name === "agent-invoke" && input?.agentSlug) return `→ ${input.agentSlug}: ${preview(input.input, 60)}`;
  if (name === "delegate_parallel" && Array.isArray(input?.tasks)) return `${input.tasks.length} subtasks`;
  if (name === "delegate_task" && input?.goal) return preview(input.goal, 60);
  return preview(input ?? "", 60);
}
