// The field names of the turn protocol in one place (docs/http-api.md): a chat is a trace, named by
// `traceId` in the `start` event and in POST /api/chat.
// (a2a-task-started's `traceId` is the callee's trace, not the chat's: never read it with traceIdOf.)

/** The chat's (trace's) id of a `start` event or a trace-shaped object. */
export function traceIdOf(event) {
  return event?.traceId ?? null;
}

/** The body of POST /api/chat: one turn of `agent` on `message`, in a new chat or in `traceId`,
 * after the message `parentSequence` (a branch) or after the head when it is null. */
export function chatBody({ agent, message, traceId = null, parentSequence = null }) {
  const body = { agent, message };
  if (traceId) body.traceId = traceId;
  if (parentSequence != null) body.parentSequence = parentSequence;
  return body;
}
