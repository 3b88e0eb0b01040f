// Wiring: sign-in, sidebar, chat view, turn controller and the agent-invoke panel.
// The open chat lives in the URL hash (#/s/<id>): a reload reopens it and resumes a running turn, and
// every chat opened is a history entry, so Back and Forward move between chats (popstate). A chat
// that no longer exists says so.

import { AgentsPage } from "./agents.js";
import { api, auth, onUnauthorized } from "./api.js";
import { ChatController, loadMessages } from "./chat.js";
import { errorText } from "./errors.js";
import { InvokePanel } from "./invoke-panel.js";
import { imageSettings } from "./markdown.js";
import { ChatView } from "./messages.js";
import { RunsBadge, RunsPage, streamUrl } from "./runs.js";
import { Sidebar } from "./sidebar.js";

const $ = (id) => document.getElementById(id);
const enc = encodeURIComponent;

let sessionId = null;
let opening = 0; // guards against a slow history load landing after another chat was opened
let missing = false; // the open link names a chat that does not exist

const view = new ChatView($("messages"), {
  onRetry: ({ user, text }) => resend({ user, text, kind: "retry" }),
  onEdit: ({ user, text }) => resend({ user, text, kind: "edit" }),
});
const panel = new InvokePanel($("invoke-panel"));
// Tool cards and subagent rows open a delegated run in the panel (again, after it was closed).
$("messages").addEventListener("open-trace", (event) => panel.openTrace(event.detail));
const sidebar = new Sidebar({
  list: $("sessions"),
  agentSelect: $("agent"),
  search: $("session-search"),
  status: $("search-status"),
  onOpen: (s) => {
    closeDrawer();
    if (s.id !== sessionId || missing) openSession(s.id);
  },
  onDelete: (s) => deleteChat(s),
  onRenamed: () => setTitle(),
  onChange: () => setTitle(),
});
const chat = new ChatController({
  view,
  panel,
  onTrace: (id) => {
    runsBadge.refresh(); // the turn's runs are stored now
    if (id === sessionId) return;
    setSession(id, { replace: true }); // the "new chat" entry of the history becomes this chat
    sidebar.loadSessions().catch(notice);
  },
  onBusy: (busy) => {
    $("send").disabled = busy;
    $("cancel").hidden = !busy;
    runsBadge.watch(busy); // a turn began or ended: the count of running work changes
  },
  onEnd: () => sidebar.loadSessions().catch(notice),
  onRefused: (err, { message, kind }) => {
    notice(err);
    if (kind === "send" && !$("input").value) $("input").value = message; // nothing typed is lost
  },
});

function setSession(id, { replace = false, push = false } = {}) {
  sessionId = id;
  missing = false;
  const url = id ? `#/s/${enc(id)}` : location.pathname;
  if (push && url !== currentUrl()) history.pushState(null, "", url);
  else if (replace || url !== currentUrl()) history.replaceState(null, "", url);
  sidebar.setActive(id);
  setTitle();
}

function currentUrl() {
  return location.hash || location.pathname;
}

/** The header says what the sidebar says of the open chat. */
function setTitle() {
  const title = missing ? "Chat not found" : (sessionId && sidebar.session(sessionId)?.title) || (sessionId ? "Chat" : "New chat");
  $("chat-title").textContent = title;
  document.title = sessionId && !missing ? `${title} · agentmesh` : "agentmesh";
}

function sessionFromHash() {
  const m = /^#\/s\/(.+)$/.exec(location.hash);
  return m ? decodeURIComponent(m[1]) : null;
}

function leaveChat() {
  chat.detach();
  panel.reset();
  hideNotice();
  updatePanelButton();
}

function newChat({ push = true } = {}) {
  leaveChat();
  view.clear();
  setSession(null, { push });
  $("input").focus();
}

async function openSession(id, { push = true } = {}) {
  const token = ++opening;
  leaveChat();
  setSession(id, { push });
  const s = sidebar.session(id);
  if (s) sidebar.agent = s.agent;
  view.clear();
  try {
    const { messages, headSequence } = await loadMessages(id);
    if (token !== opening) return;
    view.renderHistory(messages, headSequence);
    const last = view.shownPath().at(-1);
    if (last?.role === "assistant" && last.status === "pending") chat.resume(id);
  } catch (err) {
    if (token !== opening) return;
    if (err.status === 404) return showMissing();
    notice(err);
  }
}

/** The link names a chat that is gone (deleted) or was never this user's. */
function showMissing() {
  missing = true;
  sidebar.setActive(null);
  setTitle();
  view.notFound(() => newChat());
}

async function send(event) {
  event.preventDefault();
  const input = $("input");
  const message = input.value.trim();
  if (!message || chat.busy) return;
  if (!sidebar.agent) return notice("Pick an agent first.");
  input.value = "";
  hideNotice();
  if (missing) newChat({ push: false });
  await chat.send({ agent: sidebar.agent, message, traceId: sessionId, parentSequence: view.branchPoint() });
}

/** Retry, regenerate or an edited message: a new version of the last turn, branching from the
 * parent of its user message (the previous version stays one click away). */
async function resend({ user, text, kind }) {
  if (chat.busy || !sessionId) return;
  hideNotice();
  const agent = sidebar.session(sessionId)?.agent || sidebar.agent;
  await chat.send({ agent, message: text, traceId: sessionId, parentSequence: user.parentSequence || 0, replacing: user, kind });
}

/** Confirms, cancels the chat's running turn (if any), then deletes it. */
async function deleteChat(s) {
  const running = chat.busy && s.id === sessionId;
  const ok = await confirmDialog(
    `Delete “${s.title || "Untitled"}”?`,
    running
      ? "Its reply is still being written: it will be stopped, then the chat and everything in it are deleted."
      : "The chat and everything in it (its delegated runs too) are deleted. This cannot be undone.",
  );
  if (!ok) return;
  try {
    // A running turn stops first (the delete would stop it too, but then its reader would only learn
    // it from a stream that ends with the chat).
    await api(`/api/sessions/${enc(s.id)}/cancel`, { method: "POST" }).catch((err) => {
      if (err.status !== 404) throw err;
    });
    if (s.id === sessionId) await Promise.race([chat.ended, new Promise((r) => setTimeout(r, 5000))]);
    await api(`/api/sessions/${enc(s.id)}`, { method: "DELETE" });
  } catch (err) {
    return notice(err);
  }
  sidebar.drop(s.id);
  if (s.id === sessionId) newChat(); // a new entry: Back goes to the deleted chat's link
}

function confirmDialog(title, text) {
  const dialog = $("confirm");
  $("confirm-title").textContent = title;
  $("confirm-text").textContent = text;
  dialog.returnValue = "";
  return new Promise((resolve) => {
    dialog.addEventListener("close", () => resolve(dialog.returnValue === "ok"), { once: true });
    dialog.showModal();
    $("confirm-ok").focus();
  });
}

/** A message over the composer: an error in a sentence for people, or a plain text. */
function notice(err) {
  if (err?.status === 401) return; // handled by the sign-in screen
  const el = $("notice");
  el.textContent = typeof err === "string" ? err : errorText(err);
  el.hidden = false;
}

function hideNotice() {
  $("notice").hidden = true;
}

function showSignin(message = "") {
  $("app").hidden = true;
  $("signin").hidden = false;
  $("signin-error").textContent = message;
  $("signin-error").hidden = !message;
  $("api-key").value = "";
  $("api-key").focus();
}

async function enter() {
  try {
    await sidebar.loadAgents();
    await sidebar.loadSessions();
  } catch (err) {
    if (err.status !== 401) showSignin(err.message);
    return;
  }
  $("signin").hidden = true;
  $("app").hidden = false;
  runsBadge.start();
  await route();
}

/** Shows what the URL names: a chat, the agents page or a new chat. */
async function route() {
  const id = sessionFromHash();
  const agentSlug = agentsFromHash();
  if (agentSlug !== null) return openAgents(agentSlug || null, { push: false });
  closeAgents();
  const runsState = runsFromHash();
  if (runsState !== null) return openRuns(runsState, { push: false });
  closeRuns();
  if (id) {
    if (id !== sessionId || missing || !view.root.querySelector(".msg")) await openSession(id, { push: false });
  } else newChat({ push: false });
}

window.addEventListener("popstate", () => {
  if (!$("app").hidden) route();
});

onUnauthorized((err) => {
  runsBadge.stop();
  leaveChat();
  auth.clear();
  showSignin(err.message);
});

$("signin-form").addEventListener("submit", (event) => {
  event.preventDefault();
  auth.set($("api-key").value.trim());
  enter();
});
$("sign-out").addEventListener("click", () => {
  runsBadge.stop();
  newChat();
  auth.clear();
  showSignin();
});
$("new-chat").addEventListener("click", () => {
  closeDrawer();
  newChat();
});
$("composer").addEventListener("submit", send);
$("input").addEventListener("keydown", (event) => {
  if (event.key !== "Enter" || event.shiftKey || event.isComposing) return;
  event.preventDefault();
  $("composer").requestSubmit();
});
$("cancel").addEventListener("click", () => chat.cancel().catch(notice));

// ---- Small screens: the sidebar is a drawer behind the header's menu button.

/** The menu button on screen: the chat's, or the runs page's own while it shows. */
function menuButton() {
  return [...document.querySelectorAll("button.menu")].find((b) => b.getClientRects().length) ?? $("menu");
}

function openDrawer() {
  document.body.classList.add("sidebar-open");
  document.querySelectorAll("button.menu").forEach((b) => b.setAttribute("aria-expanded", "true"));
  $("scrim").hidden = false;
  $("new-chat").focus();
}

function closeDrawer() {
  if (!document.body.classList.contains("sidebar-open")) return false;
  document.body.classList.remove("sidebar-open");
  document.querySelectorAll("button.menu").forEach((b) => b.setAttribute("aria-expanded", "false"));
  $("scrim").hidden = true;
  return true;
}

const toggleDrawer = () => (document.body.classList.contains("sidebar-open") ? closeDrawer() : openDrawer());
$("menu").addEventListener("click", toggleDrawer);
$("scrim").addEventListener("click", closeDrawer);

// ---- Escape closes what lies on top: the drawer, then the panel (a dialog closes itself).

document.addEventListener("keydown", (event) => {
  if (event.key !== "Escape" || event.defaultPrevented || $("confirm").open) return;
  if (closeDrawer()) {
    menuButton().focus();
    event.preventDefault();
  } else if (panel.open) {
    panel.hide();
    updatePanelButton();
    event.preventDefault();
  }
});

// ---- The panel: the header's button shows it again while it has runs.

function updatePanelButton() {
  const n = panel.calls.length;
  $("show-panel").hidden = !n || panel.open;
  $("show-panel").textContent = `Delegated runs (${n})`;
}
new MutationObserver(updatePanelButton).observe($("invoke-panel"), { attributes: true, attributeFilter: ["hidden"] });
$("show-panel").addEventListener("click", () => {
  if (panel.calls.length) panel.show(panel.shown ?? panel.calls.at(-1), { focus: true });
});

// ---- Settings

$("remote-images").checked = imageSettings.remote;
$("remote-images").addEventListener("change", (event) => {
  imageSettings.remote = event.target.checked;
  if (sessionId) openSession(sessionId, { push: false }); // the replies render again with the new rule
});

// ---- The agents page (#/agents, #/agents/<slug>): it takes the chat's place until a chat is opened.

const agentsPage = new AgentsPage({
  root: $("agents-page"),
  onChanged: () => sidebar.loadAgents().catch(notice),
  onChat: async (slug) => {
    closeAgents();
    newChat();
    await sidebar.loadAgents().catch(notice); // a new agent is in the picker before it is picked
    sidebar.agent = slug;
    $("agent").dispatchEvent(new Event("change")); // remembered as the picked agent
  },
});

function agentsFromHash() {
  const m = /^#\/agents(?:\/(.+))?$/.exec(location.hash);
  return m ? decodeURIComponent(m[1] ?? "") : null;
}

async function openAgents(slug = null, { push = true } = {}) {
  closeRuns();
  leaveChat();
  view.clear();
  sessionId = null;
  missing = false;
  sidebar.setActive(null);
  if (push) history.pushState(null, "", slug ? `#/agents/${enc(slug)}` : "#/agents");
  $("agents-page").hidden = false;
  document.querySelector("main.chat").hidden = true;
  document.body.classList.add("agents-open");
  closeDrawer();
  await agentsPage.open(slug).catch(notice);
}

function closeAgents() {
  $("agents-page").hidden = true;
  document.querySelector("main.chat").hidden = false;
  document.body.classList.remove("agents-open");
}

$("open-agents").addEventListener("click", () => openAgents());
$("new-chat").addEventListener("click", closeAgents, true); // before newChat() runs
$("sessions").addEventListener("click", (e) => e.target.closest(".session-open") && closeAgents(), true);
$("sign-out").addEventListener("click", closeAgents, true);


// ---- The runs page (#/runs, #/runs/<state>): the caller's running and recent runs; it takes the
// chat's place like the agents page. A chat turn's link opens its chat; any other run opens in the panel.

const runsBadge = new RunsBadge($("runs-badge"));
const runsPage = new RunsPage({
  root: $("runs-page"),
  onOpenRun: (run) => {
    const name = `${run.agent}${run.title && run.title !== run.agent ? ` · ${run.title}` : ""}`;
    panel.openTrace({ name, traceId: run.traceId, taskId: run.taskId, streamUrl: streamUrl(run), opener: document.activeElement });
  },
  onCount: (n) => {
    if (n !== runsBadge.count) runsBadge.refresh();
  },
  onMenu: () => toggleDrawer(),
});

function runsFromHash() {
  const m = /^#\/runs(?:\/(.+))?$/.exec(location.hash);
  return m ? decodeURIComponent(m[1] ?? "") : null;
}

async function openRuns(state = "", { push = true } = {}) {
  closeAgents();
  leaveChat();
  view.clear();
  sessionId = null;
  missing = false;
  sidebar.setActive(null);
  if (push) history.pushState(null, "", state ? `#/runs/${enc(state)}` : "#/runs");
  $("runs-page").hidden = false;
  document.querySelector("main.chat").hidden = true;
  document.body.classList.add("runs-open");
  document.title = "Runs · agentmesh";
  closeDrawer();
  await runsPage.open(state).catch(notice);
}

function closeRuns() {
  runsPage.close();
  $("runs-page").hidden = true;
  if ($("agents-page").hidden) document.querySelector("main.chat").hidden = false;
  document.body.classList.remove("runs-open");
}

$("open-runs").addEventListener("click", () => openRuns());
$("new-chat").addEventListener("click", closeRuns, true); // before newChat() runs
$("sessions").addEventListener("click", (e) => e.target.closest(".session-open") && closeRuns(), true);
$("sign-out").addEventListener("click", closeRuns, true);

if (auth.key) enter();
else showSignin();
