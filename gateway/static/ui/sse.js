// Server-Sent Events over fetch(): EventSource can neither POST nor send an Authorization header.

const TERMINAL = new Set(["done", "error"]);

export function isEventStream(res) {
  return (res.headers.get("content-type") || "").startsWith("text/event-stream");
}

/** Yields {id, data} for each message of a text/event-stream Response (data parsed as JSON). */
export async function* readEvents(res) {
  const reader = res.body.pipeThrough(new TextDecoderStream()).getReader();
  let buffer = "";
  let id = "";
  let data = [];
  try {
    for (;;) {
      const { value, done } = await reader.read();
      if (done) return;
      buffer += value;
      // A lone "\r" at the end may be the first half of "\r\n": wait for the next chunk.
      for (let m; (m = /\r\n|\n|\r(?=[^\n])/.exec(buffer)); ) {
        const line = buffer.slice(0, m.index);
        buffer = buffer.slice(m.index + m[0].length);
        if (line === "") {
          if (data.length) yield { id, data: JSON.parse(data.join("\n")) };
          data = [];
          continue;
        }
        if (line.startsWith(":")) continue; // comment / heartbeat
        const colon = line.indexOf(":");
        const field = colon < 0 ? line : line.slice(0, colon);
        const val = colon < 0 ? "" : line.slice(colon + 1).replace(/^ /, "");
        if (field === "data") data.push(val);
        else if (field === "id") id = val;
      }
    }
  } finally {
    reader.cancel().catch(() => {});
  }
}

/**
 * Follows a stream to its terminal event (`done` or `error`), handing each event to onEvent.
 * open(lastEventId) returns the Response; after a dropped connection it is called again with the
 * last seen id, so the server resumes right after it (`Last-Event-ID`).
 * Resolves to {ended: true}, {ended: false, body} for a JSON answer (e.g. no-buffer), or {ended: false}.
 */
export async function follow(open, onEvent, { retries = 3 } = {}) {
  let lastId = "";
  for (let attempt = 0; attempt <= retries; attempt++) {
    if (attempt) await new Promise((resolve) => setTimeout(resolve, 250 * attempt));
    let res;
    try {
      res = await open(lastId);
    } catch (err) {
      if (err.name === "AbortError" || err.status) throw err; // cancelled, or an HTTP error answer
      continue; // the network dropped: try again
    }
    if (!isEventStream(res)) return { ended: false, body: await res.json() };
    try {
      for await (const { id, data } of readEvents(res)) {
        if (id) lastId = id;
        onEvent(data);
        if (TERMINAL.has(data.type)) return { ended: true };
      }
    } catch (err) {
      if (err.name === "AbortError") throw err;
    }
  }
  return { ended: false };
}

/** Headers that resume a stream after the given event id. */
export function resumeHeaders(lastId) {
  return lastId ? { "Last-Event-ID": lastId } : {};
}
