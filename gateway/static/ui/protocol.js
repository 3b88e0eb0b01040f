// The field names of the turn protocol in one place. The chat's id travels as `sessionId` in the
// `start` event and in POST /api/chat; the server is renaming it `traceId`: every read and write of it
// goes through traceIdOf() and chatBody(), so the rename is a change here only.
// (a2a-task-started's `traceId` is the callee's trace, not the chat's: never read it with traceIdOf.)

/** The chat's (trace's) id of a `start` event or a session-shaped object. */
export function traceIdOf(event) {
  return event?.traceId ?? event?.sessionId ?? null;
}

/** The body of POST /api/chat: one turn of `agent` on `message`, in a new chat or in `traceId`,
 * after the message `parentSequence` (a branch) or after the head when it is null. */
export function chatBody({ agent, message, traceId = null, parentSequence = null }) {
  const body = { agent, message };
  if (traceId) body.sessionId = traceId;
  if (parentSequence != null) body.parentSequence = parentSequence;
  return body;
}
