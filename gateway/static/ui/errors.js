// What a failure means to a person. Error codes (docs/architecture.md#event-vocabulary, and the
// reasons of HTTP error answers) become one sentence; transport detail (hosts, status lines, stack
// frames, gRPC words) is never shown.

const TEXT = {
  cancelled: "This reply was cancelled.",
  timeout: "The agent took too long, so the reply was stopped.",
  deadline_exceeded: "The server took too long to answer. Try again in a moment.",
  idle_timeout: "The reply stalled: nothing arrived for too long, so it was stopped.",
  model_timeout: "The model took too long to answer. Try again in a moment.",
  model_error: "The model answered with an error. Try again in a moment.",
  model_unreachable: "The model could not be reached. Try again in a moment.",
  unavailable: "A part of the service is not available right now. Try again in a moment.",
  shutdown: "The server is restarting. Try again in a moment.",
  interrupted: "The reply was interrupted because a part of the service restarted. What was written is kept.",
  disconnected: "The connection to the server was lost.",
  not_found: "This chat or agent no longer exists.",
  permission_denied: "You are not allowed to do that.",
  unauthenticated: "Your API key was not accepted. Sign in again.",
  invalid_argument: "The server did not accept this request.",
  depth_exceeded: "The agents called each other too deeply, so the call was refused.",
  resource_exhausted: "A limit was reached (the message is too long, or too much is running).",
  failed_precondition: "Another reply is still running in this chat. Wait for it, or cancel it.",
  already_exists: "That already exists.",
  version_mismatch: "This was changed elsewhere meanwhile. Reload it and try again.",
  remote_failed: "The other agent failed to answer.",
  internal: "Something went wrong on the server.",
  failed: "This reply failed.",
};
const BY_STATUS = { 404: "not_found", 409: "failed_precondition", 413: "resource_exhausted", 422: "invalid_argument" };

/** The lower-case code of an event error {code}, an ApiError {reason, status} or a code string. */
export function errorCode(err) {
  if (typeof err === "string") return err.toLowerCase();
  const code = (err?.code && typeof err.code === "string" ? err.code : err?.reason || "").toLowerCase();
  if (code) return code;
  if (BY_STATUS[err?.status]) return BY_STATUS[err.status];
  if (err?.status >= 500) return "unavailable";
  if (err?.name === "TypeError") return "disconnected"; // fetch() could not reach the server
  return "";
}

/** One sentence for people. */
export function errorText(err) {
  return TEXT[errorCode(err)] ?? "Something went wrong. Try again.";
}

/** The state a failed or cancelled thing ends in: "cancelled" for a cancel, else "failed". */
export function endState(err) {
  return errorCode(err) === "cancelled" ? "cancelled" : "failed";
}
