// The HTTP client: every request carries `Authorization: Bearer <key>` from localStorage, and every
// failure becomes an ApiError with the message of the gateway's JSON body {"error": {code, reason, message}}.

const KEY = "agentmesh.apiKey";
let unauthorized = () => {};

export const auth = {
  get key() {
    return localStorage.getItem(KEY) || "";
  },
  set(key) {
    localStorage.setItem(KEY, key);
  },
  clear() {
    localStorage.removeItem(KEY);
  },
};

export class ApiError extends Error {
  constructor(status, message, reason = "") {
    super(message);
    this.status = status;
    this.reason = reason;
  }
}

/** Called with the ApiError of any 401 answer (the key is wrong or was revoked). */
export function onUnauthorized(handler) {
  unauthorized = handler;
}

/** fetch() with the key; resolves to the Response when it is 2xx, else throws an ApiError. */
export async function api(path, { method = "GET", body, headers = {}, signal } = {}) {
  const init = { method, signal, headers: { ...headers, Authorization: `Bearer ${auth.key}` } };
  if (body !== undefined) {
    init.headers["Content-Type"] = "application/json";
    init.body = JSON.stringify(body);
  }
  const res = await fetch(path, init);
  if (res.ok) return res;
  const err = await errorOf(res);
  if (res.status === 401) unauthorized(err);
  throw err;
}

/** api() and then the JSON body. */
export async function json(path, options) {
  return (await api(path, options)).json();
}

async function errorOf(res) {
  try {
    const { error } = await res.json();
    return new ApiError(res.status, error?.message || res.statusText, error?.reason || "");
  } catch {
    return new ApiError(res.status, `HTTP ${res.status} ${res.statusText}`);
  }
}
