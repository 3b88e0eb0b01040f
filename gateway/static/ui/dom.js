// A tiny element builder: h("div", {class: "x", onclick: fn, dataset: {id: 1}}, "text", child).
// Text is always set as text (never parsed as HTML); markdown.js is the one place where model output
// becomes markup, and only after DOMPurify has cleaned it.

export function h(tag, props = {}, ...children) {
  const el = document.createElement(tag);
  for (const [key, value] of Object.entries(props)) {
    if (value == null || value === false) continue;
    if (key === "class") el.className = value;
    else if (key === "dataset") Object.assign(el.dataset, value);
    else if (key.startsWith("on")) el.addEventListener(key.slice(2), value);
    else el.setAttribute(key, value === true ? "" : value);
  }
  el.append(...children.flat().filter((c) => c != null && c !== false));
  return el;
}

/** A short one-line preview of any JSON value. */
export function preview(value, max = 80) {
  const text = typeof value === "string" ? value : JSON.stringify(value) ?? "";
  const line = text.replace(/\s+/g, " ").trim();
  return line.length > max ? `${line.slice(0, max - 1)}…` : line;
}

/** Pretty JSON for the expanded view of a value (strings as they are). */
export function pretty(value) {
  return typeof value === "string" ? value : JSON.stringify(value, null, 2);
}
