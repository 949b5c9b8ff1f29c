// The picker's live status page: polls GET /admin/status and draws it. No framework, no build step.
// Every value from the server is set as text (textContent), never as markup.
"use strict";

const POLL_MS = 500;
const STALE_MS = 3000;
let lastText = "";
let lastOk = 0;
let token = sessionStorage.getItem("picker-admin-token") || "";

function el(tag, attrs, ...children) {
  const node = document.createElement(tag);
  for (const [key, value] of Object.entries(attrs || {})) {
    if (key === "class") node.className = value;
    else if (key.startsWith("data-")) node.setAttribute(key, value);
    else node[key] = value;
  }
  for (const child of children) {
    if (child === null || child === undefined) continue;
    node.append(child instanceof Node ? child : String(child));
  }
  return node;
}

function seconds(value) {
  return value === null || value === undefined ? "—" : `${Number(value).toFixed(1)} s`;
}

function laneCard(lane) {
  const slots = Math.max(lane.in_flight + lane.peer_in_flight, lane.occupancy, 1);
  const bar = el("span");
  bar.style.width = `${Math.min(100, (100 * lane.occupancy) / Math.max(slots, 16))}%`;
  const card = el(
    "section",
    { class: "lane", "data-address": lane.address, "data-state": lane.state },
    el(
      "div",
      { class: "top" },
      el("span", { class: "address" }, lane.address),
      el("span", { class: "state" }, lane.state),
    ),
    el(
      "div",
      { class: "top" },
      el("span", {}, el("span", { class: "big in-flight" }, lane.in_flight), " streams in flight"),
      lane.group ? el("span", { class: `tag ${lane.group}` }, lane.group) : null,
      lane.role && lane.role !== "both" ? el("span", { class: "tag role" }, lane.role) : null,
    ),
    el("div", { class: "bar" }, bar),
    el(
      "div",
      { class: "figures" },
      el("span", {}, `occupancy ${lane.occupancy}`),
      lane.peer_in_flight ? el("span", {}, `other pickers ${lane.peer_in_flight}`) : null,
      lane.kv_pulls_pending ? el("span", { class: "pulls" }, `KV to be pulled ${lane.kv_pulls_pending}`) : null,
      el("span", {}, `picks ${lane.picks}`),
      el("span", { class: "cut" }, `cut ${lane.cut}`),
      el("span", {}, `failed ${lane.failed}`),
    ),
  );
  const drain = lane.drain;
  if (drain) {
    const waiting = lane.in_flight;
    card.append(
      el(
        "div",
        { class: "drain" },
        `draining ${seconds(drain.duration_s)}: `,
        el("b", { class: "waits-for" }, waiting),
        ` of ${drain.in_flight_at_start} streams still running` +
          (drain.pulls_at_start ? ` (${drain.pulls_at_start} of them KV hand-offs to be pulled)` : "") +
          "; " +
          `completed ${drain.ended.completed}, cut ${drain.ended.cut}, picks after start ${drain.picks_after_start}` +
          (drain.time_to_zero_s !== null ? `; zero after ${seconds(drain.time_to_zero_s)}` : ""),
      ),
    );
  }
  const actions = el("div", { class: "actions" });
  if (lane.state === "ready") {
    actions.append(el("button", { type: "button", onclick: () => act(`/admin/endpoints/${lane.address}/drain`, `Drain ${lane.address}? It gets no new request; its streams run to their end.`) }, "Drain"));
  } else if (lane.state === "draining" && lane.admin_drained) {
    actions.append(el("button", { type: "button", onclick: () => act(`/admin/endpoints/${lane.address}/undrain`, `Undrain ${lane.address}? It takes new requests again.`) }, "Undrain"));
  }
  card.append(actions);
  return card;
}

function canaryPanel(rollout) {
  if (!rollout) return el("p", { class: "muted" }, "no rollout configured");
  const panel = el("div", { id: "canary-panel", "data-phase": rollout.phase });
  panel.append(
    el(
      "div",
      { class: "kv" },
      el("span", {}, "phase ", el("b", { id: "canary-phase" }, rollout.phase)),
      el("span", {}, "weight ", el("b", { id: "canary-weight" }, `${rollout.weight}%`)),
      el("span", {}, "step ", el("b", { id: "canary-step" }, `${rollout.step + 1} of ${rollout.steps.length}`), ` ${JSON.stringify(rollout.steps)}`),
      el("span", {}, `in this step ${seconds(rollout.step_for_s)}, routed ${rollout.routed_this_step.candidate} / ${rollout.routed_this_step.stable}`),
    ),
  );
  if (rollout.rollback) panel.append(el("p", { class: "rollback", id: "canary-rollback" }, `rolled back: ${rollout.rollback.reason}`));
  const rows = rollout.gates.map((gate) =>
    el(
      "tr",
      { "data-gate": gate.gate },
      el("td", { "data-label": "gate", class: "wide" }, el("b", {}, gate.gate)),
      el("td", { "data-label": "verdict", class: gate.verdict }, gate.verdict),
      el("td", { "data-label": "samples" }, `${gate.samples[0]} / ${gate.samples[1]}`),
      el("td", { "data-label": "candidate" }, gate.candidate ?? "—"),
      el("td", { "data-label": "stable" }, gate.stable ?? "—"),
      el("td", { "data-label": "limit" }, gate.limit ?? "—"),
      el("td", { class: gate.why && !gate.why.can_gather ? "wide stuck" : "muted wide", "data-why": gate.why ? "1" : "" },
        gate.why ? `waits: ${gate.why.text}${gate.why.can_gather ? "" : " (this step cannot gather it)"}` : gate.note || gate.judges_from || ""),
    ),
  );
  panel.append(
    el(
      "div",
      { class: "table-wrap" },
      el(
        "table",
        { id: "gates" },
        el("thead", {}, el("tr", {}, ...["gate", "verdict", "samples", "candidate", "stable", "limit", "why / judges from"].map((h) => el("th", {}, h)))),
        el("tbody", {}, ...rows),
      ),
    ),
  );
  const actions = el("div", { class: "actions" });
  if (rollout.phase === "progressing" || rollout.phase === "paused") {
    actions.append(el("button", { type: "button", onclick: () => act("/admin/rollout/promote", "Promote the candidate? Every new request goes to it.") }, "Promote"));
    actions.append(el("button", { type: "button", onclick: () => act("/admin/rollout/abort", "Abort the rollout? Weight 0, the candidate drained; its streams run to their end.") }, "Abort"));
  }
  panel.append(actions);
  return panel;
}

function admission(state) {
  const box = document.getElementById("admission");
  const queue = state.queue || {};
  const items = [
    el("span", {}, "queued ", el("b", { id: "queued" }, queue.queued ?? 0)),
    el("span", {}, "queued bytes ", el("b", {}, queue.bytes ?? 0)),
    el("span", {}, "in flight ", el("b", { id: "live" }, state.live ?? 0)),
    el("span", {}, "accepting ", el("b", {}, state.accepting === false ? "no (shutting down)" : "yes")),
    state.peers ? el("span", {}, "pickers ", el("b", {}, 1 + state.peers.members.length), state.peers.unlinked.length ? ` (unlinked: ${state.peers.unlinked.join(", ")})` : "") : null,
    el("span", { class: "muted" }, `ends seen by: ${[...new Set(Object.values(state.data_planes || {}))].join(", ") || "—"}`),
  ];
  box.replaceChildren(...items.filter((item) => item !== null));
}

function drains(state) {
  const rows = (state.recent_drains || []).map((d) =>
    el(
      "tr",
      {},
      el("td", { class: "address wide" }, d.address),
      el("td", { "data-label": "cause" }, d.cause),
      el("td", { "data-label": "in flight at start" }, d.in_flight_at_start),
      el("td", { "data-label": "ended" }, Object.entries(d.ended).filter(([, n]) => n).map(([k, n]) => `${k} ${n}`).join(", ") || "—"),
      el("td", { "data-label": "picks after start" }, d.picks_after_start),
      el("td", { "data-label": "time to zero" }, seconds(d.time_to_zero_s)),
      el("td", { "data-label": "exit" }, d.exit ?? "open"),
    ),
  );
  document.querySelector("#drains tbody").replaceChildren(...rows);
}

function percent(value) {
  return value === null || value === undefined ? "—" : `${(100 * value).toFixed(1)} %`;
}

// The tenants (picker/flow/tenant_view.py): configured and busiest first, the rest summed as "other".
function tenants(state) {
  const view = state.tenants;
  document.getElementById("tenants-note").hidden = Boolean(view);
  document.getElementById("tenants").hidden = !view;
  const rows = (view ? view.rows : []).map((t) => {
    const budget = t.budget;
    return el(
      "tr",
      { "data-tenant": t.tenant },
      el("td", { class: "wide" }, el("b", {}, t.tenant)),
      el("td", { "data-label": "weight" }, t.weight ?? "—"),
      el("td", { "data-label": "share" }, percent(t.share)),
      el("td", { "data-label": "queued", class: "queued" }, t.queued ?? "—"),
      el("td", { "data-label": "in flight", class: "in-flight" }, t.in_flight ?? "—"),
      el("td", { "data-label": "tokens", class: "tokens" }, t.tokens ?? "—"),
      el("td", { "data-label": "token share" }, percent(t.token_share)),
      el("td", { "data-label": "held back" }, t.held_back ?? "—"),
      el("td", { "data-label": "budget left", class: "budget" }, budget ? `${budget.level} of ${budget.burst} (${budget.tokens_per_minute}/min)` : "—"),
      el("td", { "data-label": "over budget", class: "over-budget" }, t.over_budget),
    );
  });
  document.querySelector("#tenants tbody").replaceChildren(...rows);
}

function draw(state) {
  document.getElementById("source").textContent = `source: ${state.source}`;
  document.getElementById("lanes").replaceChildren(...state.lanes.map(laneCard));
  document.getElementById("canary").replaceChildren(canaryPanel(state.rollout));
  admission(state);
  tenants(state);
  drains(state);
}

async function poll() {
  try {
    // admin.read_auth: a reader needs what /metrics needs; the admin token entered below serves too
    const headers = token ? { Authorization: `Bearer ${token}` } : {};
    const answer = await fetch("/admin/status", { cache: "no-store", headers });
    if (answer.ok) {
      const text = await answer.text();
      lastOk = Date.now();
      if (text !== lastText) {
        lastText = text;
        draw(JSON.parse(text));
      }
    }
  } catch (error) {
    // the picker is unreachable: the header says so below
  }
  const updated = document.getElementById("updated");
  const age = Date.now() - lastOk;
  updated.classList.toggle("stale", age > STALE_MS);
  updated.textContent = lastOk ? (age > STALE_MS ? `no answer for ${Math.round(age / 1000)} s` : `live, ${new Date(lastOk).toLocaleTimeString()}`) : "connecting…";
  setTimeout(poll, POLL_MS);
}

async function act(path, question) {
  if (!token || !window.confirm(question)) return;
  const message = document.getElementById("message");
  try {
    const answer = await fetch(path, { method: "POST", headers: { Authorization: `Bearer ${token}`, "X-Picker-Admin": "status-page" } });
    const body = await answer.json().catch(() => ({}));
    message.textContent = answer.ok ? `done: ${path}` : `refused (${answer.status}): ${(body.error && body.error.message) || ""}`;
  } catch (error) {
    message.textContent = `could not reach the picker: ${error}`;
  }
  lastText = "";
}

function setToken(value) {
  token = value;
  if (value) sessionStorage.setItem("picker-admin-token", value);
  else sessionStorage.removeItem("picker-admin-token");
  document.body.classList.toggle("unlocked", Boolean(value));
}

document.getElementById("unlock-button").addEventListener("click", () => setToken(document.getElementById("token").value.trim()));
document.getElementById("lock-button").addEventListener("click", () => setToken(""));
setToken(token);
poll();
