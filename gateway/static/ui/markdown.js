// Markdown for model output (replies, the agent-invoke panel, subagent cards). marked turns the text
// into HTML and DOMPurify cleans it before any of it reaches the page: no script elements, no on*
// handlers, no javascript: URLs, no iframes; nothing that can restyle the page, hold a form or clobber
// the UI's element ids either. This module is the only place where model output becomes markup.
// Both libraries come from npm: `make setup` copies their ES module builds into ./vendor/.

import { Marked } from "./vendor/marked.esm.js";
import createDOMPurify from "./vendor/purify.es.mjs";

// GFM (tables, fenced code, strikethrough, autolinks); a single newline is a line break, as model
// output is written to be read line by line.
const marked = new Marked({ gfm: true, breaks: true });

// Our own DOMPurify instance, so the hook below applies to this module only.
const purify = createDOMPurify(window);

const CONFIG = {
  // On top of DOMPurify's defaults (which already drop script, iframe, object, embed, on* attributes
  // and javascript: / vbscript: / non-image data: URLs): no style (it would restyle the whole UI), no
  // form controls, and no id/name (an element with the id of one of ours would shadow it).
  FORBID_TAGS: ["style", "form", "input", "button", "textarea", "select", "option", "optgroup", "datalist", "dialog"],
  FORBID_ATTR: ["style", "id", "name", "popover", "popovertarget", "popovertargetaction", "command", "commandfor"],
  RETURN_DOM_FRAGMENT: true, // nodes, so the cleaned markup is never parsed a second time
};

// Every remaining link opens in a new tab without access to this one.
purify.addHook("afterSanitizeAttributes", (node) => {
  if (node.nodeName === "A" && node.hasAttribute("href")) {
    node.setAttribute("target", "_blank");
    node.setAttribute("rel", "noopener noreferrer");
  }
});

/** The markdown text as a sanitised DocumentFragment (plain text if it cannot be parsed). */
export function markdown(text) {
  try {
    return purify.sanitize(marked.parse(text), CONFIG);
  } catch {
    const fragment = document.createDocumentFragment();
    fragment.append(text);
    return fragment;
  }
}

/** Replaces the element's children with the rendered markdown. */
export function renderMarkdown(el, text) {
  el.classList.add("markdown");
  el.replaceChildren(markdown(text));
}

/**
 * Markdown that grows while it streams: append() and set() only note the text; the element is
 * re-rendered at most once per animation frame (flush() renders at once, e.g. for restored history).
 * around(render), when given, wraps each render (the message list keeps its scroll pinned with it).
 */
export class LiveMarkdown {
  constructor(el, around = (render) => render()) {
    this.el = el;
    this.around = around;
    this.text = "";
    this.frame = 0;
    el.classList.add("markdown");
  }

  append(delta) {
    if (!delta) return;
    this.text += delta;
    this.schedule();
  }

  set(text) {
    if (text === this.text) return;
    this.text = text;
    this.schedule();
  }

  schedule() {
    if (!this.frame) this.frame = requestAnimationFrame(() => this.flush());
  }

  /** Renders now if a render is pending. */
  flush() {
    if (!this.frame) return;
    cancelAnimationFrame(this.frame);
    this.frame = 0;
    this.around(() => renderMarkdown(this.el, this.text));
  }

  /** Drops a pending render (the element is being thrown away). */
  cancel() {
    cancelAnimationFrame(this.frame);
    this.frame = 0;
  }
}
