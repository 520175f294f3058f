// Client of the server's OpenAI-compatible API: the API key (kept in
// sessionStorage), OpenAI-style JSON errors, the model list, and chat
// completions streamed as server-sent events.

const KEY_STORAGE = "pagedserve.apiKey";

/** An error answered by the API: its HTTP status and the message of its
 * {"error": {"message": ...}} body. */
export class ApiError extends Error {
  constructor(status, message) {
    super(message);
    this.name = "ApiError";
    this.status = status;
  }
}

/** Stores the API key sent as `Authorization: Bearer <key>` from now on. */
export function setApiKey(key) {
  sessionStorage.setItem(KEY_STORAGE, key);
}

function headers() {
  const key = sessionStorage.getItem(KEY_STORAGE);
  return {
    "Content-Type": "application/json",
    ...(key ? { Authorization: `Bearer ${key}` } : {}),
  };
}

async function errorOf(response) {
  const text = await response.text();
  try {
    return new ApiError(response.status, JSON.parse(text).error.message);
  } catch {
    return new ApiError(response.status, text || response.statusText);
  }
}

/** GETs `path` (relative to the page) with the API key; its parsed JSON body. */
export async function getJson(path) {
  const response = await fetch(path, { headers: headers(), cache: "no-store" });
  if (!response.ok) throw await errorOf(response);
  return response.json();
}

/** The ids of the served models (GET /v1/models). */
export async function listModels() {
  const response = await fetch("v1/models", { headers: headers() });
  if (!response.ok) throw await errorOf(response);
  return (await response.json()).data.map((card) => card.id);
}

/** POSTs `request` to /v1/chat/completions as a stream with usage and yields
 * each chunk (parsed JSON) as it arrives, until `data: [DONE]`. Aborting
 * `signal` closes the connection; the server then aborts the request. */
export async function* streamChat(request, signal) {
  const response = await fetch("v1/chat/completions", {
    method: "POST",
    headers: headers(),
    body: JSON.stringify({ ...request, stream: true, stream_options: { include_usage: true } }),
    signal,
  });
  if (!response.ok) throw await errorOf(response);
  const reader = response.body.pipeThrough(new TextDecoderStream()).getReader();
  let buffer = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) throw new Error("the answer's stream ended before [DONE]");
    buffer += value;
    let end;
    while ((end = buffer.indexOf("\n\n")) >= 0) {
      const event = buffer.slice(0, end);
      buffer = buffer.slice(end + 2);
      for (const line of event.split("\n")) {
        if (!line.startsWith("data:")) continue;
        const data = line.slice(5).trim();
        if (data === "[DONE]") return;
        yield JSON.parse(data);
      }
    }
  }
}
