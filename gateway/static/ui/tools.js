// A compact tool card: name, a one-line preview of the input, a status; input and output on expand.
// The status is the call's own (running, completed, failed, cancelled), the same live and restored:
// a call that never got its output settles with its turn's end (cancelled by a cancel, else failed).
// An agent-invoke card offers to open each callee in the side panel, from the moment its task exists
// (while it runs, and again after the panel was closed) and from the history; the card sends an
// `open-trace` event that bubbles up to the page, which hands it to the panel.

import { h, preview, pretty } from "./dom.js";
import { endState, errorText } from "./errors.js";

export const STATUS_LABEL = { running: "running", completed: "completed", failed: "failed", cancelled: "cancelled" };

/** The state of a stored call (metadata.toolCalls[i]) of a message with status `messageStatus`. */
export function storedCallState(call, messageStatus) {
  if (STATUS_LABEL[call.status]) return call.status; // the call's own stored state, where there is one
  if (call.ok) return "completed";
  if (!("output" in call) && !("ok" in call) && messageStatus === "pending") return "running";
  const code = call.output && typeof call.output === "object" ? call.output.code : "";
  // A call its turn's cancel cut off carries no error code of its own.
  if (code === "cancelled" || (!code && messageStatus === "cancelled")) return "cancelled";
  return "failed";
}

export class ToolCard {
  constructor({ toolCallId, toolName, input }) {
    this.input = input;
    this.name = toolName;
    this.state = "running";
    this.tasks = new Map(); // taskId -> open button (agent-invoke)
    this.badge = h("span", { class: "badge", dataset: { status: "running" } }, STATUS_LABEL.running);
    this.output = h("pre", { class: "tool-output" });
    this.actions = h("span", { class: "tool-actions" });
    const body = h(
      "div",
      { class: "tool-body", hidden: true },
      h("div", { class: "tool-label" }, "Input"),
      h("pre", {}, pretty(input ?? {})),
      h("div", { class: "tool-label" }, "Output"),
      this.output,
    );
    const toggle = h(
      "button",
      {
        type: "button",
        class: "tool-toggle",
        "aria-expanded": "false",
        title: "Show the call's input and output",
        onclick: () => {
          body.hidden = !body.hidden;
          toggle.setAttribute("aria-expanded", String(!body.hidden));
        },
      },
      h("span", { class: "tool-name" }, toolName),
      h("span", { class: "tool-arg" }, summarize(toolName, input)),
    );
    this.el = h(
      "div",
      { class: "tool", dataset: { toolCallId, tool: toolName, status: "running" } },
      h("div", { class: "tool-head" }, toggle, this.actions, this.badge),
      body,
    );
  }

  get running() {
    return this.state === "running";
  }

  setState(state) {
    this.state = state;
    this.badge.textContent = STATUS_LABEL[state] ?? state;
    this.badge.dataset.status = state;
    this.el.dataset.status = state;
  }

  /** tool-output-available (or the stored call): {ok, output, metadata}. */
  finish({ ok, output, metadata }, state = null) {
    const code = typeof output === "object" ? output?.code : "";
    this.setState(state ?? (ok ? "completed" : code === "cancelled" ? "cancelled" : "failed"));
    this.output.textContent = pretty(output ?? "");
    if (this.name === "agent-invoke") this.offerTraces(output, metadata);
  }

  /** The turn ended without this call's output: it ends as its turn did. */
  settle(error) {
    if (!this.running) return;
    this.setState(endState(error));
    if (!this.output.textContent) this.output.textContent = errorText(error);
  }

  /** a2a-task-started: the callee can be opened (and reopened) in the panel while it runs. Its
   * `traceId` is where the callee runs (a peer's `@alias/id` for a remote one); the panel opens our
   * record of the exchange (`localTraceId`) when there is one: it reads even with the peer gone. */
  taskStarted(ev) {
    this.addOpen({
      taskId: ev.taskId,
      traceId: ev.localTraceId || ev.traceId,
      name: ev.calleeAgentName || ev.calleeAgentSlug || this.input?.agentSlug || "agent",
      toolCallId: this.el.dataset.toolCallId,
    });
  }

  /** One "open" button per callee that ran (a task id and a trace id in the output). */
  offerTraces(output, metadata) {
    const runs = Array.isArray(output?.results) ? output.results : [output];
    for (const run of runs) {
      const taskId = run?.taskId || (runs.length === 1 ? metadata?.taskId : "");
      const one = runs.length === 1 ? metadata : null;
      const traceId = run?.localTraceId || run?.traceId || one?.localTraceId || one?.traceId || "";
      if (!taskId || !traceId) continue;
      // A remote callee's traceId names its home (@alias/id, agent://host/id); our record is local.
      this.addOpen({ taskId, traceId, name: this.input?.agentSlug || this.input?.agentUrl || "agent", toolCallId: this.el.dataset.toolCallId });
    }
  }

  addOpen({ taskId, traceId, name, toolCallId }) {
    const known = this.tasks.get(taskId);
    if (known) {
      if (traceId) known.detail.traceId = traceId;
      return;
    }
    const detail = { taskId, traceId, name, toolCallId, streamUrl: `/api/agents/a2a/stream?taskId=${encodeURIComponent(taskId)}` };
    const open = () => {
      this.el.dispatchEvent(new CustomEvent("open-trace", { bubbles: true, detail: { ...detail, opener: button } }));
    };
    const n = this.tasks.size + 1;
    const button = h(
      "button",
      { type: "button", class: "link open-trace", title: `Open ${name}'s reply in the side panel`, "aria-label": `Open ${name}'s reply${n > 1 ? ` ${n}` : ""} in the side panel`, onclick: open },
      n > 1 ? `open ${n}` : "open",
    );
    button.detail = detail;
    this.tasks.set(taskId, button);
    this.actions.append(button);
    if (this.tasks.size === 2) this.tasks.values().next().value.textContent = "open 1";
  }
}

function summarize(name, input) {
  if (name === "agent-invoke" && input?.agentSlug) return `→ ${input.agentSlug}: ${preview(input.input, 60)}`;
  if (name === "delegate_parallel" && Array.isArray(input?.tasks)) return `${input.tasks.length} subtasks`;
  if (name === "delegate_task" && input?.goal) return preview(input.goal, 60);
  return preview(input ?? "", 60);
}
