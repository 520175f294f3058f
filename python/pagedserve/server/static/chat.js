// The chat page: the conversation (the messages sent with each request),
// answers streamed into the page as text, Stop, New chat, the sampling
// settings, the API-key prompt and the live panel.

import { ApiError, listModels, setApiKey, streamChat } from "./api.js";
import { pollKvMap } from "./kvmap.js";
import { pollMetrics } from "./metrics.js";

const $ = (id) => document.getElementById(id);

const state = {
  model: null, // the served model's id, from /v1/models
  messages: [], // the conversation so far, as the API takes it
  controller: null, // AbortController of the answer being streamed
  unsent: null, // the text of a turn refused with 401, sent again once a key is entered
};

function setStatus(text) {
  $("status").textContent = text;
}

function showError(message) {
  $("error").textContent = message;
  $("error").hidden = !message;
}

function addMessage(role, text) {
  const item = document.createElement("div");
  item.className = `message ${role}`;
  item.textContent = text;
  $("conversation").append(item);
  item.scrollIntoView({ block: "end" });
  return item;
}

function setBusy(busy) {
  $("send").disabled = busy;
  $("new-chat").disabled = busy;
  $("stop").disabled = !busy;
}

/** The sampling settings; a blank field is left out (the server's default). */
function readSettings() {
  const settings = {};
  for (const [id, name] of [["temperature", "temperature"], ["top-p", "top_p"],
                            ["max-tokens", "max_tokens"], ["seed", "seed"]]) {
    const value = $(id).value.trim();
    if (value !== "") settings[name] = Number(value);
  }
  return settings;
}

const isUnauthorized = (error) => error instanceof ApiError && error.status === 401;

function askForKey(message) {
  $("key-message").textContent = message;
  $("key-form").hidden = false;
  $("api-key").focus();
}

async function loadModel() {
  try {
    [state.model] = await listModels();
    $("model").textContent = state.model ?? "no model";
  } catch (error) {
    if (isUnauthorized(error)) askForKey(error.message);
    else showError(error.message);
  }
}

function showUsage(usage, elapsedMs) {
  if (!usage) return;
  $("stat-tps").textContent = (usage.completion_tokens / (elapsedMs / 1000)).toFixed(1);
  const cached = usage.prompt_tokens_details?.cached_tokens ?? 0;
  $("stat-cached").textContent = `${cached} of ${usage.prompt_tokens}`;
}

/** Sends `text` as the next user turn and streams the answer into the page.
 * A turn that fails before any text is taken back; a stopped one keeps its
 * partial answer in the conversation. */
async function send(text) {
  showError("");
  state.messages.push({ role: "user", content: text });
  const question = addMessage("user", text);
  const answer = addMessage("assistant", "");
  state.controller = new AbortController();
  setBusy(true);
  setStatus("Generating…");
  for (const id of ["stat-ttft", "stat-tps", "stat-cached"]) $(id).textContent = "–";
  const sent = performance.now();
  let streaming = false; // a content delta has arrived
  let usage = null;
  let finish = null;
  try {
    const request = { model: state.model ?? undefined, messages: state.messages, ...readSettings() };
    for await (const chunk of streamChat(request, state.controller.signal)) {
      usage = chunk.usage ?? usage;
      for (const choice of chunk.choices) {
        if (choice.delta.content) {
          if (!streaming) $("stat-ttft").textContent = `${Math.round(performance.now() - sent)} ms`;
          streaming = true;
          answer.append(choice.delta.content); // a text node: the model's output is never parsed as HTML
          answer.scrollIntoView({ block: "end" });
        }
        finish = choice.finish_reason ?? finish;
      }
    }
    showUsage(usage, performance.now() - sent);
    state.messages.push({ role: "assistant", content: answer.textContent });
    setStatus(finish === "length" ? "Done (max_tokens reached)" : "Done");
  } catch (error) {
    const stopped = error.name === "AbortError";
    if (stopped && answer.textContent) {
      state.messages.push({ role: "assistant", content: answer.textContent });
      answer.classList.add("stopped");
    } else {
      state.messages.pop();
      question.remove();
      answer.remove();
    }
    setStatus(stopped ? "Stopped" : "");
    if (isUnauthorized(error)) {
      state.unsent = text;
      askForKey(error.message);
    } else if (!stopped) {
      showError(error.message);
    }
  } finally {
    state.controller = null;
    setBusy(false);
  }
}

function showMetrics(values) {
  const show = (id, name, format) => {
    const value = values?.get(name);
    $(id).textContent = value === undefined ? "unavailable" : format(value);
  };
  show("stat-kv", "vllm:kv_cache_usage_perc", (v) => `${(100 * v).toFixed(1)} %`);
  show("stat-running", "vllm:num_requests_running", String);
}

$("composer").addEventListener("submit", (event) => {
  event.preventDefault();
  const text = $("prompt").value.trim();
  if (!text || state.controller) return;
  $("prompt").value = "";
  send(text);
});
$("prompt").addEventListener("keydown", (event) => {
  if (event.key === "Enter" && !event.shiftKey && !event.isComposing) {
    event.preventDefault();
    $("composer").requestSubmit();
  }
});
$("stop").addEventListener("click", () => state.controller?.abort());
$("new-chat").addEventListener("click", () => {
  state.messages = [];
  $("conversation").replaceChildren();
  showError("");
  setStatus("");
  $("prompt").focus();
});
$("key-form").addEventListener("submit", (event) => {
  event.preventDefault();
  setApiKey($("api-key").value.trim());
  $("key-form").hidden = true;
  if (!state.model) loadModel();
  if (state.unsent !== null) {
    const text = state.unsent;
    state.unsent = null;
    send(text);
  }
});

loadModel();
pollMetrics(showMetrics);
pollKvMap();
