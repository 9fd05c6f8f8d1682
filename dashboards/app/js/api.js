// The API client: the token from the browser session, JSON calls, and Server-Sent Events
// read with fetch() so that the token travels in a header, never in a URL.

const TOKEN_KEY = "etrain.token";

export const session = {
  token: () => sessionStorage.getItem(TOKEN_KEY),
  signIn: (token) => sessionStorage.setItem(TOKEN_KEY, token),
  signOut: () => sessionStorage.removeItem(TOKEN_KEY),
};

// Set by main.js: what to do when the API says the token is not (or no longer) valid.
let onUnauthorized = () => {};
export function whenUnauthorized(handler) {
  onUnauthorized = handler;
}

export class ApiError extends Error {
  constructor(status, problem) {
    super(problem?.detail || problem?.title || `HTTP ${status}`);
    this.status = status;
    this.problem = problem || {};
    this.errors = Array.isArray(problem?.errors) ? problem.errors : [];
  }
}

function headers(extra = {}, token = session.token()) {
  return { Authorization: `Bearer ${token}`, ...extra };
}

async function failure(response, sessionToken = true) {
  const text = await response.text();
  let problem;
  try {
    problem = JSON.parse(text);
  } catch {
    problem = { title: response.statusText, detail: text.slice(0, 300) };
  }
  if (response.status === 401 && sessionToken) onUnauthorized();
  return new ApiError(response.status, problem);
}

// Paths are relative ("v1/jobs"): the dashboard works under any prefix it is served at.
export async function api(path, { method = "GET", body, signal, token } = {}) {
  const extra = { Accept: "application/json" };
  if (body !== undefined) extra["Content-Type"] = "application/json";
  const response = await fetch(path, {
    method,
    signal,
    headers: headers(extra, token ?? session.token()),
    body: body === undefined ? undefined : JSON.stringify(body),
    cache: "no-store",
  });
  if (!response.ok) throw await failure(response, token === undefined);
  return response.status === 204 ? null : response.json();
}

// Reads one SSE response to its end, calling onMessage({id, event, data}) per message.
async function readStream(path, { onMessage, onOpen, signal, lastEventId }) {
  const extra = { Accept: "text/event-stream" };
  if (lastEventId != null) extra["Last-Event-ID"] = String(lastEventId);
  const response = await fetch(path, { headers: headers(extra), signal, cache: "no-store" });
  if (!response.ok) throw await failure(response);
  onOpen?.();
  const reader = response.body.pipeThrough(new TextDecoderStream()).getReader();
  let buffer = "";
  let message = { data: [] };
  for (;;) {
    const { value, done } = await reader.read();
    if (done) return;
    buffer += value;
    let end;
    while ((end = buffer.indexOf("\n")) >= 0) {
      let line = buffer.slice(0, end);
      buffer = buffer.slice(end + 1);
      if (line.endsWith("\r")) line = line.slice(0, -1);
      if (line === "") {
        if (message.data.length) {
          onMessage({
            id: message.id,
            event: message.event || "message",
            data: JSON.parse(message.data.join("\n")),
          });
        }
        message = { data: [] };
        continue;
      }
      if (line.startsWith(":")) continue; // keep-alive comment
      const colon = line.indexOf(":");
      const field = colon < 0 ? line : line.slice(0, colon);
      let text = colon < 0 ? "" : line.slice(colon + 1);
      if (text.startsWith(" ")) text = text.slice(1);
      if (field === "data") message.data.push(text);
      else if (field === "id") message.id = text;
      else if (field === "event") message.event = text;
    }
  }
}

// Follows a stream: reconnects after a network error or a "reconnect" message, resuming
// from the last id, until the server ends it (resolve) or the signal aborts it.
// onStatus("live" | "reconnecting") lets a page show whether it is live.
export async function follow(path, { onMessage, onStatus, onReconnect, signal, endless = false }) {
  let lastEventId = null;
  let delay = 500;
  while (!signal.aborted) {
    let resync = false;
    try {
      await readStream(path, {
        signal,
        lastEventId,
        onOpen: () => {
          delay = 500;
          onStatus?.("live");
        },
        onMessage: (m) => {
          if (m.event === "reconnect") {
            resync = true;
            return;
          }
          if (m.id != null) lastEventId = m.id;
          onMessage(m);
        },
      });
      if (!endless && !resync) return;
    } catch (error) {
      if (signal.aborted) return;
      if (error instanceof ApiError && error.status !== 503) throw error;
    }
    onStatus?.("reconnecting");
    await sleep(delay, signal);
    delay = Math.min(delay * 2, 10_000);
    onReconnect?.();
  }
}

export function sleep(ms, signal) {
  return new Promise((resolve) => {
    const timer = setTimeout(resolve, ms);
    signal?.addEventListener("abort", () => {
      clearTimeout(timer);
      resolve();
    }, { once: true });
  });
}
