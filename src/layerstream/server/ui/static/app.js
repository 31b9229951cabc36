// The layerstream page: a client of the public API only (GET /health, the job routes and their event
// streams). Standard browser APIs (fetch, EventSource, FormData), no libraries, no build step.
"use strict";

const POLL_MS = 4000; // the job list is read again this often: jobs made by other clients show up too
const LIST_LIMIT = 100;
// a browser opens at most 6 connections to one HTTP/1.1 server and each event stream holds one while its job
// is unfinished: follow a few (the running job first), and leave the others to the poll and to fetch
const MAX_STREAMS = 3;
// a server started with --api-key: the page asks for the key once and keeps it in a cookie of this server. Its
// own requests send it as a header; what the browser fetches by itself (the event streams, <video> and <img>
// sources, the download link) carries the cookie, which the server counts on reads from this page only
const KEY_COOKIE = "layerstream_api_key";

const state = {
  health: null,
  jobsPath: null,
  jobs: new Map(), // id -> the job object, as the API last gave it
  previews: new Map(), // id -> the latest preview image (a data URL)
  streams: new Map(), // id -> its EventSource, while the job is not finished
  historyCards: new Map(), // id -> its <li> in the history (made once: a finished job does not change)
  poll: null, // the job list's timer, once the list has been read
};

const $ = (selector) => document.querySelector(selector);

function isFinished(job) {
  return job.status === "completed" || job.status === "failed";
}

class KeyNeeded extends Error {}

function savedKey() {
  const entry = document.cookie.split("; ").find((part) => part.startsWith(`${KEY_COOKIE}=`));
  return entry ? decodeURIComponent(entry.slice(KEY_COOKIE.length + 1)) : null;
}

function saveKey(key) {
  const secure = location.protocol === "https:" ? "; Secure" : "";
  document.cookie = `${KEY_COOKIE}=${encodeURIComponent(key)}; Path=/; SameSite=Strict${secure}`;
}

async function api(method, path, body) {
  const options = { method, headers: {} };
  if (body !== undefined) options.body = body; // a FormData: the browser sets the multipart content type
  const key = savedKey();
  if (key) options.headers.Authorization = `Bearer ${key}`;
  const response = await fetch(path, options);
  const text = await response.text();
  let data = null;
  try {
    data = text ? JSON.parse(text) : null;
  } catch (error) {
    data = null;
  }
  if (!response.ok) {
    const message = data && data.error ? data.error.message : `${response.status} ${response.statusText}`;
    if (response.status === 401) throw new KeyNeeded(message);
    throw new Error(message);
  }
  return data;
}

// --- formatting ---------------------------------------------------------------------------------------------

function formatSeconds(seconds) {
  if (seconds === null || seconds === undefined) return "–";
  if (seconds < 1) return `${(seconds * 1000).toFixed(0)} ms`;
  if (seconds < 90) return `${seconds.toFixed(1)} s`;
  return `${Math.floor(seconds / 60)} min ${Math.round(seconds % 60)} s`;
}

function formatBytes(bytes) {
  if (!bytes) return "0 B";
  const units = ["B", "KB", "MB", "GB", "TB"];
  const power = Math.min(units.length - 1, Math.floor(Math.log10(bytes) / 3));
  return `${(bytes / 1000 ** power).toFixed(power ? 1 : 0)} ${units[power]}`;
}

function settingsLine(settings) {
  const parts = [settings.size];
  if (settings.num_frames) parts.push(`${settings.num_frames} frames`);
  parts.push(`${settings.num_inference_steps} steps`, `seed ${settings.seed}`);
  if (settings.guidance_scale !== null && settings.guidance_scale !== undefined) parts.push(`guidance ${settings.guidance_scale}`);
  // vllm-omni's fields, where the job gave them
  const given = [
    ["guidance_scale_2", "guidance 2"], ["true_cfg_scale", "true CFG"],
    ["boundary_ratio", "boundary"], ["flow_shift", "flow shift"],
  ];
  for (const [name, label] of given) {
    if (settings[name] !== null && settings[name] !== undefined) parts.push(`${label} ${settings[name]}`);
  }
  if (settings.fps) parts.push(`${settings.fps} fps`);
  if (settings.has_input_image) parts.push("input image");
  return parts.join(" · ");
}

function element(tag, properties = {}, children = []) {
  const node = document.createElement(tag);
  for (const [key, value] of Object.entries(properties)) {
    if (key === "text") node.textContent = value;
    else if (key === "class") node.className = value;
    else if (key.startsWith("data-") || key.startsWith("aria-") || key === "role") node.setAttribute(key, value);
    else node[key] = value;
  }
  for (const child of children) node.append(child);
  return node;
}

// --- the form -----------------------------------------------------------------------------------------------

function configureForm(health) {
  const isVideo = health.kind === "video";
  $("#model").textContent = `${health.model} · ${health.kind} · ${health.device}`;
  $("#size").value = health.default_size || "";
  $("#steps").value = health.default_steps || "";
  for (const node of document.querySelectorAll(".video-only")) node.hidden = !isVideo;
  if (isVideo) {
    $("#length").value = health.default_num_frames || "";
    updateLengthHint();
  }
  const imageField = $(".image-only");
  imageField.hidden = !health.takes_image;
  if (health.takes_image) {
    $("#image-hint").textContent =
      health.image_input === "required" ? "This model needs an input image." : "Optional: the image to start from.";
  }
}

function updateLengthHint() {
  const health = state.health;
  const value = Number($("#length").value);
  const hint = $("#length-hint");
  if (!health || health.kind !== "video" || !value) {
    hint.textContent = "";
    return;
  }
  const fps = health.fps || 16;
  hint.textContent =
    $("#length-unit").value === "frames"
      ? `${value} frames ≈ ${(value / fps).toFixed(2)} s at ${fps} fps`
      : `${value} s at ${fps} fps, rounded to the model's frame rule`;
}

function formBody() {
  const body = new FormData();
  const text = (selector) => $(selector).value.trim();
  body.append("prompt", text("#prompt"));
  for (const [selector, name] of [["#negative-prompt", "negative_prompt"], ["#size", "size"],
    ["#steps", "num_inference_steps"], ["#seed", "seed"], ["#guidance", "guidance_scale"]]) {
    if (text(selector)) body.append(name, text(selector));
  }
  if (state.health.kind === "video" && text("#length")) {
    body.append($("#length-unit").value === "frames" ? "num_frames" : "seconds", text("#length"));
  }
  const file = $("#image").files[0];
  if (state.health.takes_image && file) {
    body.append(state.health.kind === "video" ? "input_reference" : "image", file);
  }
  body.append("preview", $("#preview").checked ? "true" : "false");
  return body;
}

async function submitJob(event) {
  event.preventDefault();
  const error = $("#form-error");
  error.hidden = true;
  if (!$("#prompt").value.trim()) {
    error.textContent = "Write a prompt first.";
    error.hidden = false;
    return;
  }
  const button = $("#generate");
  button.disabled = true;
  try {
    const job = await api("POST", state.jobsPath, formBody());
    track(job);
    render();
  } catch (failure) {
    if (failure instanceof KeyNeeded) askForKey(failure.message);
    error.textContent = failure.message;
    error.hidden = false;
  } finally {
    button.disabled = false;
  }
}

function useSettings(job) {
  const settings = job.layerstream.settings;
  $("#prompt").value = settings.prompt;
  $("#negative-prompt").value = settings.negative_prompt || "";
  $("#size").value = settings.size;
  $("#steps").value = settings.num_inference_steps;
  $("#seed").value = settings.seed;
  $("#guidance").value = settings.guidance_scale ?? "";
  if (settings.num_frames) {
    $("#length").value = settings.num_frames;
    $("#length-unit").value = "frames";
    updateLengthHint();
  }
  const error = $("#form-error");
  error.hidden = !settings.has_input_image;
  error.textContent = settings.has_input_image ? "This job had an input image: choose it again." : "";
  $("#prompt").focus();
  window.scrollTo({ top: 0, behavior: "smooth" });
}

// --- jobs and their event streams ---------------------------------------------------------------------------

function track(job) {
  state.jobs.set(job.id, job);
  followMore();
}

function followMore() {
  const order = (job) => (job.status === "in_progress" ? 0 : job.layerstream.queue_position ?? 1e9);
  const unfollowed = [...state.jobs.values()]
    .filter((job) => !isFinished(job) && !state.streams.has(job.id))
    .sort((a, b) => order(a) - order(b) || a.created_at - b.created_at);
  for (const job of unfollowed.slice(0, Math.max(0, MAX_STREAMS - state.streams.size))) follow(job.id);
}

function follow(id) {
  const source = new EventSource(`${state.jobsPath}/${encodeURIComponent(id)}/events`);
  state.streams.set(id, source);
  source.addEventListener("status", (event) => {
    const job = JSON.parse(event.data);
    if (job.deleted) {
      forget(id); // deleted elsewhere; the server ends the stream now
    } else {
      state.jobs.set(id, job);
      if (isFinished(job)) stopFollowing(id); // the server ends the stream now; no reconnection wanted
    }
    followMore();
    render();
  });
  source.addEventListener("progress", (event) => {
    const progress = JSON.parse(event.data);
    const job = state.jobs.get(id);
    if (!job) return;
    job.progress = progress.progress;
    Object.assign(job.layerstream, {
      step: progress.step,
      total_steps: progress.total,
      seconds_per_step: progress.seconds_per_step,
      eta_seconds: progress.eta_seconds,
      streamed_bytes: progress.streamed_bytes,
      stall_seconds: progress.stall_seconds,
    });
    renderRunning();
  });
  source.addEventListener("preview", (event) => {
    state.previews.set(id, JSON.parse(event.data).image);
    renderRunning();
  });
  // on an error the browser reconnects by itself (a restarted server answers with the job's status)
}

function stopFollowing(id) {
  const source = state.streams.get(id);
  if (source) source.close();
  state.streams.delete(id);
  state.previews.delete(id);
}

async function refreshJobs() {
  try {
    const page = await api("GET", `${state.jobsPath}?limit=${LIST_LIMIT}`);
    const listed = new Set(page.data.map((job) => job.id));
    for (const job of page.data) {
      if (!state.streams.has(job.id)) track(job); // a followed job is kept current by its stream
    }
    if (!page.has_more) {
      for (const id of [...state.jobs.keys()]) if (!listed.has(id)) forget(id); // deleted elsewhere
    }
    $("#server-state").textContent = "";
    render();
  } catch (failure) {
    if (failure instanceof KeyNeeded) throw failure;
    $("#server-state").textContent = `server unreachable: ${failure.message}`;
  }
}

function forget(id) {
  stopFollowing(id);
  state.jobs.delete(id);
  const card = state.historyCards.get(id);
  if (card) card.remove();
  state.historyCards.delete(id);
}

async function deleteJob(id) {
  try {
    await api("DELETE", `${state.jobsPath}/${encodeURIComponent(id)}`);
  } catch (failure) {
    if (!/not found|404/i.test(failure.message)) {
      window.alert(failure.message);
      return;
    }
  }
  forget(id);
  render();
}

// --- rendering ----------------------------------------------------------------------------------------------

function jobsWith(status) {
  return [...state.jobs.values()].filter((job) => job.status === status);
}

function render() {
  renderRunning();
  renderQueue();
  renderHistory();
}

function renderRunning() {
  const box = $("#running");
  const running = jobsWith("in_progress").sort((a, b) => a.created_at - b.created_at);
  if (!running.length) {
    if (!box.querySelector(".empty")) box.replaceChildren(element("p", { class: "empty", text: "Nothing is running." }));
    return;
  }
  const cards = running.map((job) => {
    let card = box.querySelector(`[data-job="${CSS.escape(job.id)}"]`);
    if (!card) card = runningCard(job);
    updateRunningCard(card, job);
    return card;
  });
  box.replaceChildren(...cards);
}

function runningCard(job) {
  const bar = element("div", { class: "bar-fill" });
  const progress = element("div", {
    class: "progress", role: "progressbar", "aria-valuemin": "0", "aria-valuemax": "100", "aria-valuenow": "0",
    "aria-label": `Progress of ${job.id}`,
  }, [bar]);
  const preview = element("img", { class: "preview", alt: "Live preview" });
  preview.hidden = true;
  return element("article", { class: "running-card", "data-job": job.id }, [
    element("div", { class: "running-text" }, [
      element("p", { class: "prompt", text: job.prompt }),
      element("p", { class: "settings", text: settingsLine(job.layerstream.settings) }),
      progress,
      element("p", { class: "timings" }),
      element("div", { class: "actions" }, [
        element("button", { type: "button", class: "link danger", text: "Cancel", onclick: () => deleteJob(job.id) }),
      ]),
    ]),
    preview,
  ]);
}

function updateRunningCard(card, job) {
  const live = job.layerstream;
  const percent = Math.max(0, Math.min(100, Math.round(job.progress || 0)));
  const progress = card.querySelector("[role=progressbar]");
  progress.setAttribute("aria-valuenow", String(percent));
  progress.firstChild.style.width = `${percent}%`;
  const step = live.total_steps ? `Step ${live.step} of ${live.total_steps}` : "Starting";
  card.querySelector(".timings").textContent = [
    `${step} · ${percent}%`,
    live.seconds_per_step ? `${formatSeconds(live.seconds_per_step)}/step` : null,
    live.eta_seconds !== null && live.eta_seconds !== undefined ? `ETA ${formatSeconds(live.eta_seconds)}` : null,
    `${formatBytes(live.streamed_bytes)} streamed`,
    `stall ${formatSeconds(live.stall_seconds || 0)}`,
  ].filter(Boolean).join(" · ");
  const image = state.previews.get(job.id);
  const preview = card.querySelector(".preview");
  if (image && preview.src !== image) {
    preview.src = image;
    preview.hidden = false;
  }
}

function renderQueue() {
  const queued = jobsWith("queued").sort(
    (a, b) => (a.layerstream.queue_position ?? 1e9) - (b.layerstream.queue_position ?? 1e9) || a.created_at - b.created_at,
  );
  $("#queue").replaceChildren(...queued.map((job) => element("li", { "data-job": job.id }, [
    element("span", { class: "position", text: `#${job.layerstream.queue_position ?? "?"}` }),
    element("span", { class: "prompt", text: job.prompt }),
    element("span", { class: "settings", text: settingsLine(job.layerstream.settings) }),
    element("button", { type: "button", class: "link danger", text: "Cancel", onclick: () => deleteJob(job.id) }),
  ])));
  $("#queue-count").textContent = queued.length ? `(${queued.length})` : "";
  $("#queue-empty").hidden = queued.length > 0;
}

function renderHistory() {
  const list = $("#history");
  const finished = [...state.jobs.values()].filter(isFinished).sort((a, b) => b.created_at - a.created_at);
  for (const job of finished) {
    if (!state.historyCards.has(job.id)) state.historyCards.set(job.id, historyCard(job));
  }
  // newest first; cards are moved, never made again (a playing video keeps playing)
  finished.forEach((job, index) => {
    const card = state.historyCards.get(job.id);
    if (list.children[index] !== card) list.insertBefore(card, list.children[index] || null);
  });
  $("#history-empty").hidden = finished.length > 0;
}

function historyCard(job) {
  const content = `${state.jobsPath}/${encodeURIComponent(job.id)}/content`;
  let media;
  if (job.status === "failed") {
    const reason = job.error ? job.error.message : "failed";
    media = element("div", { class: "media failed", text: reason });
  } else if (job.object === "video") {
    media = element("video", { class: "media", src: content, controls: true, loop: true, muted: true, playsInline: true, preload: "metadata" });
  } else {
    media = element("img", { class: "media", src: content, alt: job.prompt, loading: "lazy" });
  }
  // created_at and completed_at are whole seconds (OpenAI's fields): the generation's own time is exact
  const waited = job.completed_at ? job.completed_at - job.created_at : null;
  const took = job.inference_time_s != null ? formatSeconds(job.inference_time_s)
    : waited === null ? null : waited < 1 ? "under 1 s" : formatSeconds(waited);
  const live = job.layerstream;
  const timings = [
    took ? `took ${took}` : null,
    live.seconds_per_step ? `${formatSeconds(live.seconds_per_step)}/step` : null,
    live.streamed_bytes ? `${formatBytes(live.streamed_bytes)} streamed` : null,
  ].filter(Boolean).join(" · ");
  const extension = job.object === "video" ? "mp4" : "png";
  const actions = [
    element("button", { type: "button", class: "link", text: "Use these settings", onclick: () => useSettings(job) }),
    element("button", { type: "button", class: "link danger", text: "Delete", onclick: () => deleteJob(job.id) }),
  ];
  if (job.status === "completed") {
    actions.unshift(element("a", { class: "link", href: content, download: `${job.id}.${extension}`, text: "Download" }));
  }
  return element("li", { class: `history-card ${job.status}`, "data-job": job.id }, [
    media,
    element("div", { class: "details" }, [
      element("p", { class: "prompt", text: job.prompt }),
      element("p", { class: "settings", text: settingsLine(live.settings) }),
      element("p", { class: "timings", text: timings }),
      element("div", { class: "actions" }, actions),
    ]),
  ]);
}

// --- start --------------------------------------------------------------------------------------------------

function askForKey(message) {
  $("#key-form").hidden = false;
  $(".layout").hidden = true;
  const error = $("#key-error");
  error.textContent = savedKey() ? `The key was refused: ${message}` : "";
  error.hidden = !savedKey();
  $("#api-key").focus();
}

async function useKey(event) {
  event.preventDefault();
  const key = $("#api-key").value.trim();
  if (!key) return;
  saveKey(key);
  $("#api-key").value = "";
  await showJobs();
}

// the job list, then every POLL_MS; asks for the key first if the server wants one
async function showJobs() {
  try {
    await refreshJobs();
  } catch (failure) {
    askForKey(failure.message);
    return;
  }
  $("#key-form").hidden = true;
  $(".layout").hidden = false;
  if (!state.poll) {
    state.poll = window.setInterval(() => refreshJobs().catch((failure) => askForKey(failure.message)), POLL_MS);
  }
}

async function start() {
  $("#job-form").addEventListener("submit", submitJob);
  $("#key-form").addEventListener("submit", useKey);
  $("#length").addEventListener("input", updateLengthHint);
  $("#length-unit").addEventListener("change", updateLengthHint);
  try {
    state.health = await api("GET", "/health");
  } catch (failure) {
    $("#model").textContent = `cannot reach the server: ${failure.message}`;
    return;
  }
  configureForm(state.health);
  state.jobsPath = state.health.jobs_path;
  if (!state.jobsPath) {
    $("#server-state").textContent = "this server does not serve the job API";
    $("#generate").disabled = true;
    return;
  }
  await showJobs();
}

start();
