// Wiring: sign-in, sidebar, chat view, turn controller and the agent-invoke panel.
// The open session lives in the URL hash (#/s/<id>), so a reload reopens it and resumes a running turn.

import { AgentsPage } from "./agents.js";
import { auth, json, onUnauthorized } from "./api.js";
import { ChatController } from "./chat.js";
import { InvokePanel } from "./invoke-panel.js";
import { ChatView } from "./messages.js";
import { Sidebar } from "./sidebar.js";

const $ = (id) => document.getElementById(id);

const view = new ChatView($("messages"));
const panel = new InvokePanel($("invoke-panel"));
// Tool cards and subagent rows of the history open a delegated run's trace in the panel.
$("messages").addEventListener("open-trace", (event) => panel.openTrace(event.detail));
const sidebar = new Sidebar({
  list: $("sessions"),
  agentSelect: $("agent"),
  onOpen: (s) => openSession(s.id),
  onDeleted: (id) => id === sessionId && newChat(),
  onRenamed: (s) => s.id === sessionId && setTitle(),
});
const chat = new ChatController({
  view,
  panel,
  onSession: (id) => {
    if (id === sessionId) return;
    setSession(id);
    sidebar.loadSessions().catch(showError);
  },
  onBusy: (busy) => {
    $("send").disabled = busy;
    $("cancel").hidden = !busy;
  },
  onEnd: () => sidebar.loadSessions().then(() => setTitle()).catch(showError),
});
let sessionId = null;
let opening = 0; // guards against a slow history load landing after another session was opened

function setSession(id) {
  sessionId = id;
  history.replaceState(null, "", id ? `#/s/${encodeURIComponent(id)}` : location.pathname);
  sidebar.setActive(id);
  setTitle();
}

function setTitle() {
  $("chat-title").textContent = (sessionId && sidebar.session(sessionId)?.title) || "New chat";
}

function sessionFromHash() {
  const m = /^#\/s\/(.+)$/.exec(location.hash);
  return m ? decodeURIComponent(m[1]) : null;
}

function newChat() {
  chat.detach();
  panel.reset();
  view.clear();
  setSession(null);
  $("input").focus();
}

async function openSession(id) {
  const token = ++opening;
  chat.detach();
  panel.reset();
  setSession(id);
  const s = sidebar.session(id);
  if (s) sidebar.agent = s.agent;
  try {
    const { messages } = await json(`/api/sessions/${encodeURIComponent(id)}/messages`);
    if (token !== opening) return;
    view.renderHistory(messages);
    const last = messages.at(-1);
    if (last?.role === "assistant" && last.status === "pending") chat.resume(id);
  } catch (err) {
    if (token !== opening) return;
    if (err.status === 404) return newChat();
    showError(err);
  }
}

async function send(event) {
  event.preventDefault();
  const input = $("input");
  const message = input.value.trim();
  if (!message || chat.busy) return;
  if (!sidebar.agent) return showError(new Error("pick an agent first"));
  input.value = "";
  await chat.send({ agent: sidebar.agent, message, sessionId });
}

function showError(err) {
  if (err.status === 401) return; // handled by the sign-in screen
  view.addAssistant().error({ code: err.reason?.toLowerCase() || "", message: err.message });
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
  const id = sessionFromHash();
  const agentSlug = agentsFromHash();
  if (agentSlug !== null) await openAgents(agentSlug || null);
  else if (id) await openSession(id);
  else newChat();
}

onUnauthorized((err) => {
  chat.detach();
  panel.reset();
  auth.clear();
  showSignin(err.message);
});

$("signin-form").addEventListener("submit", (event) => {
  event.preventDefault();
  auth.set($("api-key").value.trim());
  enter();
});
$("sign-out").addEventListener("click", () => {
  newChat();
  auth.clear();
  showSignin();
});
$("new-chat").addEventListener("click", newChat);
$("composer").addEventListener("submit", send);
$("input").addEventListener("keydown", (event) => {
  if (event.key !== "Enter" || event.shiftKey || event.isComposing) return;
  event.preventDefault();
  $("composer").requestSubmit();
});
$("cancel").addEventListener("click", () => chat.cancel().catch(showError));

// ---- The agents page (#/agents, #/agents/<slug>): it takes the chat's place until a chat is opened.

const agentsPage = new AgentsPage({
  root: $("agents-page"),
  onChanged: () => sidebar.loadAgents().catch(showError),
  onChat: async (slug) => {
    closeAgents();
    newChat();
    await sidebar.loadAgents().catch(showError); // a new agent is in the picker before it is picked
    sidebar.agent = slug;
    $("agent").dispatchEvent(new Event("change")); // remembered as the picked agent
  },
});

function agentsFromHash() {
  const m = /^#\/agents(?:\/(.+))?$/.exec(location.hash);
  return m ? decodeURIComponent(m[1] ?? "") : null;
}

async function openAgents(slug = null) {
  newChat(); // the chat is left (its turn goes on): coming back opens a session or a new chat
  $("agents-page").hidden = false;
  document.querySelector("main.chat").hidden = true;
  document.body.classList.add("agents-open");
  await agentsPage.open(slug).catch(showError);
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

if (auth.key) enter();
else showSignin();
