// Markdown for model output (replies, the agent-invoke panel, subagent cards). marked turns the text
// into HTML and DOMPurify cleans it before any of it reaches the page: no script elements, no on*
// handlers, no javascript: URLs, no iframes; nothing that can restyle the page, hold a form or clobber
// the UI's element ids either. This module is the only place where model output becomes markup.
// The libraries come from npm: `make setup` copies their ES module builds into ./vendor/.
//
// - Rendering is incremental: the text is split into top-level blocks and only the blocks that changed
//   since the last render are rendered again, so a streaming reply keeps its finished paragraphs,
//   tables and images as they are (an image is fetched once, not on every frame).
// - Images load only from the mesh's own origin (or data: images), unless the reader allowed other
//   sites (imageSettings.remote); a blocked image is shown as a link the reader can open.
// - Fenced code is highlighted by highlight.js (when it names a language it knows) and gets a Copy
//   button.

import hljs from "./vendor/highlight.min.js";
import { Marked } from "./vendor/marked.esm.js";
import createDOMPurify from "./vendor/purify.es.mjs";

// GFM (tables, fenced code, strikethrough, autolinks); a single newline is a line break, as model
// output is written to be read line by line.
const marked = new Marked({ gfm: true, breaks: true });

// Our own DOMPurify instance, so the hooks below apply to this module only.
const purify = createDOMPurify(window);

const CONFIG = {
  // On top of DOMPurify's defaults (which already drop script, iframe, object, embed, on* attributes
  // and javascript: / vbscript: / non-image data: URLs): no style (it would restyle the whole UI), no
  // form controls, no id/name (an element with the id of one of ours would shadow it), and no media
  // but <img> (whose source is checked below).
  FORBID_TAGS: [
    "style", "form", "input", "button", "textarea", "select", "option", "optgroup", "datalist", "dialog",
    "video", "audio", "source", "track", "picture", "image", "feImage",
  ],
  FORBID_ATTR: [
    "style", "id", "name", "popover", "popovertarget", "popovertargetaction", "command", "commandfor",
    "srcset", "ping", "background", "poster",
  ],
  RETURN_DOM_FRAGMENT: true, // nodes of an inert document: nothing loads before they are inserted
};
const HIGHLIGHTED = { ALLOWED_TAGS: ["span"], ALLOWED_ATTR: ["class"], RETURN_DOM_FRAGMENT: true };

const REMOTE_IMAGES = "agentmesh.remoteImages";

/** The reader's setting: may model output show images from other sites? (this browser only) */
export const imageSettings = {
  get remote() {
    return localStorage.getItem(REMOTE_IMAGES) === "1";
  },
  set remote(on) {
    if (on) localStorage.setItem(REMOTE_IMAGES, "1");
    else localStorage.removeItem(REMOTE_IMAGES);
  },
};

/** May an image with this src load? Our origin and data: images always; other sites when allowed. */
export function imageAllowed(src) {
  let url;
  try {
    url = new URL(src, location.href);
  } catch {
    return false;
  }
  if (url.protocol === "data:") return true; // DOMPurify keeps data: URLs on images only
  if (url.protocol !== "http:" && url.protocol !== "https:") return false;
  return url.origin === location.origin || imageSettings.remote;
}

purify.addHook("afterSanitizeAttributes", (node) => {
  // Every remaining link opens in a new tab without access to this one.
  if (node.nodeName === "A" && node.hasAttribute("href")) {
    node.setAttribute("target", "_blank");
    node.setAttribute("rel", "noopener noreferrer");
  }
  // An image from elsewhere loses its source before it can load (this document is inert).
  if (node.nodeName === "IMG") {
    const src = node.getAttribute("src") || "";
    if (!imageAllowed(src)) {
      node.removeAttribute("src");
      node.setAttribute("data-blocked-src", src);
    }
    node.setAttribute("loading", "lazy");
  }
});

/** The blocks of the text (marked's top-level tokens) with the reference links they share. */
function lex(text) {
  try {
    return marked.lexer(text);
  } catch {
    const tokens = [{ type: "paragraph", raw: text, text, tokens: [{ type: "text", raw: text, text }] }];
    tokens.links = {};
    return tokens;
  }
}

/** One block as sanitised, post-processed nodes. */
function renderBlock(token, links) {
  const one = [token];
  one.links = links;
  let fragment;
  try {
    fragment = purify.sanitize(marked.parser(one), CONFIG);
  } catch {
    fragment = document.createDocumentFragment();
    fragment.append(token.raw);
  }
  for (const img of fragment.querySelectorAll("img[data-blocked-src]")) img.replaceWith(blockedImage(img));
  for (const pre of fragment.querySelectorAll("pre")) decorateCode(pre);
  return [...fragment.childNodes];
}

/** A blocked image: its alt text and where it was from, as a link the reader may follow. */
function blockedImage(img) {
  const src = img.getAttribute("data-blocked-src") || "";
  const span = document.createElement("span");
  span.className = "img-blocked";
  let host = "";
  try {
    host = new URL(src, location.href).host;
  } catch {
    /* not a URL: no link */
  }
  const label = `Image${img.alt ? ` “${img.alt}”` : ""} from ${host || "another site"} not loaded`;
  if (/^https?:/i.test(src)) {
    const a = document.createElement("a");
    a.href = src;
    a.target = "_blank";
    a.rel = "noopener noreferrer";
    a.textContent = label;
    span.append(a);
  } else span.textContent = label;
  span.title = "Images from other sites are off: see Settings in the sidebar";
  return span;
}

/** A fenced block: highlighted when its language is known, in a frame with its language and Copy. */
function decorateCode(pre) {
  const code = pre.querySelector("code");
  if (!code) return;
  const lang = /(?:^|\s)language-([\w+#.-]+)/.exec(code.className)?.[1] ?? "";
  if (lang && hljs.getLanguage(lang)) {
    try {
      const html = hljs.highlight(code.textContent, { language: lang, ignoreIllegals: true }).value;
      code.replaceChildren(purify.sanitize(html, HIGHLIGHTED));
      code.classList.add("hljs");
    } catch {
      /* left plain */
    }
  }
  const frame = document.createElement("div");
  frame.className = "code-block";
  const head = document.createElement("div");
  head.className = "code-head";
  const label = document.createElement("span");
  label.className = "code-lang";
  label.textContent = lang || "code";
  const copy = document.createElement("button");
  copy.type = "button";
  copy.className = "code-copy";
  copy.textContent = "Copy";
  copy.setAttribute("aria-label", `Copy ${lang || "code"} to the clipboard`);
  copy.addEventListener("click", () => copyText(copy, code.textContent));
  head.append(label, copy);
  pre.replaceWith(frame);
  frame.append(head, pre);
}

async function copyText(button, text) {
  let ok = false;
  try {
    await navigator.clipboard.writeText(text);
    ok = true;
  } catch {
    // No clipboard API (a page not served over https or loopback): the old way.
    const area = document.createElement("textarea");
    area.value = text;
    area.setAttribute("readonly", "");
    area.style.position = "fixed";
    area.style.opacity = "0";
    document.body.append(area);
    area.select();
    ok = document.execCommand("copy");
    area.remove();
  }
  button.textContent = ok ? "Copied" : "Copy failed";
  clearTimeout(button._reset);
  button._reset = setTimeout(() => (button.textContent = "Copy"), 2000);
}

/** The markdown text as a sanitised DocumentFragment. */
export function markdown(text) {
  const tokens = lex(text);
  const fragment = document.createDocumentFragment();
  for (const token of tokens) fragment.append(...renderBlock(token, tokens.links));
  return fragment;
}

/** Replaces the element's children with the rendered markdown. */
export function renderMarkdown(el, text) {
  el.classList.add("markdown");
  el.replaceChildren(markdown(text));
}

/**
 * Markdown that grows while it streams: append() and set() only note the text; the element is
 * rendered at most once per animation frame (flush() renders at once, e.g. for restored history),
 * and a render only replaces the blocks whose source changed. An image of a block that is rendered
 * again keeps its element (it is not fetched again).
 * around(render), when given, wraps each render (the message list keeps its scroll pinned with it).
 */
export class LiveMarkdown {
  constructor(el, around = (render) => render()) {
    this.el = el;
    this.around = around;
    this.text = "";
    this.frame = 0;
    this.blocks = []; // [{raw, nodes}] as on the page
    this.links = "{}";
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
    this.around(() => this.render());
  }

  /** Drops a pending render (the element is being thrown away). */
  cancel() {
    cancelAnimationFrame(this.frame);
    this.frame = 0;
  }

  render() {
    const tokens = lex(this.text);
    const links = JSON.stringify(tokens.links ?? {});
    let same = 0;
    if (links === this.links && this.blocks.every((b) => b.nodes.every((n) => n.parentNode === this.el))) {
      while (same < this.blocks.length && same < tokens.length && this.blocks[same].raw === tokens[same].raw) same++;
    } else {
      this.blocks.forEach((b) => b.nodes.forEach((n) => n.parentNode === this.el && n.remove()));
      this.blocks = [];
      this.el.replaceChildren();
    }
    this.links = links;
    // The images of the blocks rendered again, by source: reused so that they are not fetched again.
    const images = new Map();
    for (const block of this.blocks.splice(same)) {
      for (const node of block.nodes) {
        if (node.nodeType === Node.ELEMENT_NODE) {
          for (const img of node.querySelectorAll("img[src]")) {
            const key = img.getAttribute("src");
            if (!images.has(key)) images.set(key, []);
            images.get(key).push(img);
          }
        }
        node.remove();
      }
    }
    const added = [];
    const kept = []; // [mark, old image]: swapped once the new nodes are in this document
    for (const token of tokens.slice(same)) {
      const nodes = renderBlock(token, tokens.links);
      for (const node of nodes) {
        if (node.nodeType !== Node.ELEMENT_NODE) continue; // (marked puts every image inside a block)
        for (const img of node.querySelectorAll("img[src]")) {
          const old = images.get(img.getAttribute("src"))?.shift();
          if (!old || old.alt !== img.alt || old.title !== img.title) continue;
          // The old element must not pass through the sanitiser's document: an image that changes
          // documents is fetched again.
          const mark = document.createComment("img");
          img.replaceWith(mark);
          kept.push([mark, old]);
        }
      }
      added.push(...nodes);
      this.blocks.push({ raw: token.raw, nodes });
    }
    this.el.append(...added); // one change of the element per render
    for (const [mark, old] of kept) mark.replaceWith(old);
  }
}
