// gpumgr dashboard: polls the REST API once a second and draws the map, the accounts, the containers,
// the queue and recent events. Plain DOM, no framework, nothing fetched but this manager's own API.
// API data (names come from users) only ever goes through textContent or attributes, never HTML.
"use strict";

(function () {
  const POLL_MS = 1000;
  const EVENTS_KEPT = 50;
  const EVENTS_RESYNC_POLLS = 15; // re-read the whole log now and then: ids restart with the manager
  const ENDED_SHOWN = 10;
  const TOKEN_KEY = "gpumgr.token";
  const NEAR = 0.9;
  const LIVE = new Set(["creating", "running"]);

  const state = {
    nodes: [],
    nodesByName: new Map(), // the map as held: the whole of one answer, then the changes of each next one
    nodesVersion: "", // the map's version of the last answer: the next asks only for what changed since (issue 20)
    containers: [],
    accounts: [], // empty: no accounts configured, and the panel stays hidden
    events: [],
    lastEventId: 0,
    polls: 0,
    lastOk: 0,
    needToken: false,
    signature: "",
    timer: null,
    inFlight: false,
    again: false,
  };

  // ---- small helpers ----------------------------------------------------------------------------
  const $ = (id) => document.getElementById(id);

  function el(tag, attrs, ...children) {
    const node = document.createElement(tag);
    if (attrs) {
      for (const [key, value] of Object.entries(attrs)) {
        if (value === undefined || value === null || value === false) continue;
        if (key === "class") node.className = value;
        else if (key === "text") node.textContent = String(value);
        else if (key === "style") Object.assign(node.style, value);
        else node.setAttribute(key, String(value));
      }
    }
    for (const child of children) {
      if (child === undefined || child === null || child === false) continue;
      node.append(child instanceof Node ? child : document.createTextNode(String(child)));
    }
    return node;
  }

  function bytes(n) {
    if (n === null || n === undefined || !Number.isFinite(n)) return "–";
    const abs = Math.abs(n);
    if (abs >= 1024 ** 4) return (n / 1024 ** 4).toFixed(2) + " TiB";
    if (abs >= 1024 ** 3) return trim(n / 1024 ** 3) + " GiB";
    if (abs >= 1024 ** 2) return trim(n / 1024 ** 2) + " MiB";
    if (abs >= 1024) return trim(n / 1024) + " KiB";
    return n + " B";
  }

  function trim(x) {
    const s = x >= 100 ? x.toFixed(0) : x >= 10 ? x.toFixed(1) : x.toFixed(2);
    return s.includes(".") ? s.replace(/\.?0+$/, "") : s;
  }

  function ago(seconds) {
    if (!Number.isFinite(seconds)) return "–";
    const s = Math.max(0, Math.round(seconds));
    if (s < 60) return s + "s";
    if (s < 3600) return Math.floor(s / 60) + "m " + (s % 60) + "s";
    if (s < 86400) return Math.floor(s / 3600) + "h " + Math.floor((s % 3600) / 60) + "m";
    return Math.floor(s / 86400) + "d " + Math.floor((s % 86400) / 3600) + "h";
  }

  function clock(unix) {
    const d = new Date(unix * 1000);
    return d.toLocaleTimeString([], { hour: "2-digit", minute: "2-digit", second: "2-digit", hour12: false });
  }

  function pct(part, whole) {
    return whole > 0 ? Math.max(0, Math.min(100, (100 * part) / whole)) : 0;
  }

  function shortId(id) {
    return id ? String(id).slice(0, 12) : "";
  }

  // ---- the token --------------------------------------------------------------------------------
  function token() {
    try {
      return sessionStorage.getItem(TOKEN_KEY) || "";
    } catch (_) {
      return "";
    }
  }

  function setToken(value) {
    state.nodesVersion = ""; // another caller may see another map: read it whole (issue 20)
    try {
      if (value) sessionStorage.setItem(TOKEN_KEY, value);
      else sessionStorage.removeItem(TOKEN_KEY);
    } catch (_) {
      /* storage refused (private mode): the token lives until reload */
    }
    $("forget-token").hidden = !value;
  }

  class Unauthorized extends Error {}

  async function api(path) {
    const headers = { Accept: "application/json" };
    const t = token();
    if (t) headers.Authorization = "Bearer " + t;
    const response = await fetch(path, { headers, cache: "no-store" });
    if (response.status === 401) throw new Unauthorized("unauthorized");
    if (!response.ok) {
      let message = response.status + " " + response.statusText;
      try {
        const body = await response.json();
        if (body && body.error && body.error.message) message = body.error.message;
      } catch (_) {
        /* not JSON */
      }
      throw new Error(path + ": " + message);
    }
    return response.json();
  }

  function askForToken(wrong) {
    state.needToken = true;
    $("login").hidden = false;
    $("content").hidden = true;
    const error = $("login-error");
    error.hidden = !wrong;
    error.textContent = wrong ? "That token was refused." : "";
    setStatus("token needed", "auth");
    const input = $("token-input");
    if (document.activeElement !== input) input.focus();
  }

  function hideLogin() {
    state.needToken = false;
    $("login").hidden = true;
    $("content").hidden = false;
  }

  // ---- polling ----------------------------------------------------------------------------------
  async function poll() {
    if (state.inFlight) {
      state.again = true; // one loop only: the running poll starts the next at once
      return;
    }
    clearTimeout(state.timer);
    state.timer = null;
    if (state.needToken) return; // waits for the form
    state.inFlight = true;
    try {
      await pollOnce();
    } finally {
      state.inFlight = false;
    }
    if (state.again) {
      state.again = false;
      poll();
    } else if (!state.needToken) {
      state.timer = setTimeout(poll, POLL_MS);
    }
  }

  async function pollOnce() {
    state.polls += 1;
    const resync = state.polls % EVENTS_RESYNC_POLLS === 0;
    const since = resync ? 0 : state.lastEventId;
    try {
      // the nodes first: without a (valid) token one 401 is enough to ask for it
      const changes = state.nodesVersion ? "?since=" + encodeURIComponent(state.nodesVersion) : "";
      const nodes = await api("/v1/nodes" + changes); // issue 20
      const [containers, events, accounts] = await Promise.all([
        api("/v1/containers"),
        api("/v1/events?since=" + encodeURIComponent(since)),
        api("/v1/accounts"),
      ]);
      mergeNodes(nodes); // issue 20
      state.containers = Array.isArray(containers.containers) ? containers.containers : [];
      state.accounts = Array.isArray(accounts.accounts) ? accounts.accounts : [];
      mergeEvents(Array.isArray(events.events) ? events.events : [], resync);
      state.lastOk = Date.now() / 1000;
      hideLogin();
      setStatus("live", "ok");
      render();
    } catch (err) {
      state.nodesVersion = ""; // the next poll reads the whole map again (issue 20)
      if (err instanceof Unauthorized) {
        askForToken(Boolean(token()));
        return;
      }
      setStatus("cannot reach the manager: " + (err && err.message ? err.message : err), "error");
    }
  }

  // A whole map ("full": true, or an answer without a version) replaces what is held; otherwise the
  // nodes listed replace theirs (a new one goes last, as on the manager) and the removed ones go.
  function mergeNodes(answer) {
    const listed = answer && Array.isArray(answer.nodes) ? answer.nodes : [];
    if (!answer || answer.full !== false) state.nodesByName = new Map();
    else for (const name of Array.isArray(answer.removed) ? answer.removed : []) state.nodesByName.delete(name);
    for (const node of listed) state.nodesByName.set(node.name, node);
    state.nodes = Array.from(state.nodesByName.values());
    state.nodesVersion = answer && typeof answer.version === "string" ? answer.version : "";
  } // issue 20

  function mergeEvents(fresh, whole) {
    if (whole) {
      // a full read: it is the truth (and catches a manager restart, whose ids start again at 1)
      state.events = fresh.slice(-EVENTS_KEPT);
    } else {
      const known = new Set(state.events.map((e) => e.id));
      for (const e of fresh) if (!known.has(e.id)) state.events.push(e);
      state.events = state.events.slice(-EVENTS_KEPT);
    }
    const last = state.events.length ? state.events[state.events.length - 1].id : 0;
    state.lastEventId = whole ? last : Math.max(state.lastEventId, last);
  }

  function setStatus(text, kind) {
    const s = $("status");
    s.textContent = text;
    s.dataset.status = kind;
  }

  // ---- rendering --------------------------------------------------------------------------------
  function render() {
    const signature = JSON.stringify([state.nodes, state.containers, state.accounts,
      state.events.length && state.lastEventId]);
    if (signature !== state.signature) {
      state.signature = signature;
      const byId = new Map(state.containers.map((c) => [c.id, c]));
      renderSummary();
      renderNodes(byId);
      renderAccounts();
      renderContainers();
      renderQueue();
      renderEvents(byId);
    }
    renderTimes();
  }

  function renderSummary() {
    const nodes = state.nodes;
    const gpus = nodes.flatMap((n) => n.gpus || []);
    const ready = nodes.filter((n) => n.state === "ready").length;
    const total = gpus.reduce((a, g) => a + (g.memory_total || 0), 0);
    const reserved = gpus.reduce((a, g) => a + (g.memory_reserved || 0), 0);
    $("sum-nodes").textContent = ready + " / " + nodes.length;
    $("sum-gpus").textContent = String(gpus.length);
    $("sum-memory").textContent = bytes(reserved) + " / " + bytes(total);
    $("sum-running").textContent = String(state.containers.filter((c) => c.state === "running").length);
    $("sum-queue").textContent = String(state.containers.filter((c) => c.state === "queued").length);
  }

  function renderNodes(byId) {
    const box = $("nodes");
    if (!state.nodes.length) {
      box.replaceChildren(el("p", { class: "empty", text: "no node has registered" }));
      return;
    }
    box.replaceChildren(...state.nodes.map((node) => nodeCard(node, byId)));
  }

  function nodeCard(node, byId) {
    const ready = node.state === "ready";
    const head = el("div", { class: "node-head" },
      el("h3", { class: "node-name", text: node.name }),
      ...Object.entries(node.labels || {}).map(([k, v]) => el("span", { class: "muted label", text: k + "=" + v })),
      el("span", { class: "badge " + (ready ? "ok" : "down"), "data-node-state": node.state, text: node.state }),
      node.runtime ? el("span", { class: "muted", text: node.runtime }) : null,
      el("span", { class: "muted seen", "data-last-seen": node.last_seen, text: "" }));
    const gpus = (node.gpus || []).map((gpu) => gpuRow(gpu, byId));
    return el("article", { class: "card node" + (ready ? "" : " is-down"), "data-node": node.name }, head,
      gpus.length ? el("div", { class: "gpus" }, ...gpus) : el("p", { class: "empty", text: "no GPUs" }));
  }

  function gpuRow(gpu, byId) {
    const total = gpu.memory_total || 0;
    const bar = el("div", { class: "bar", role: "img", "aria-label": "memory of GPU " + gpu.index });
    let known = 0;
    for (const id of gpu.containers || []) {
      const c = byId.get(id);
      const grant = c ? c.gpu_memory || 0 : 0;
      known += grant;
      const used = c ? perGpuUse(c) : 0;
      const cap = c ? Math.max(grant, c.gpu_memory_limit || 0) : grant;  // a burster may use up to its limit
      const ratio = cap > 0 ? used / cap : 0;
      const name = c ? c.name || shortId(c.id) : shortId(id);
      const tip = name + " (" + shortId(id) + ")" + (c && c.tenant ? ", tenant " + c.tenant : "") +
        ": grant " + bytes(grant) + (cap > grant ? " up to " + bytes(cap) : "") + ", used " + bytes(used) +
        (grant ? " (" + Math.round(100 * used / grant) + "% of the grant)" : "");
      const segment = el("div", {
        class: "seg grant" + (ratio > 1 ? " over" : ratio >= NEAR ? " near" : ""),
        "data-grant": id, title: tip, style: { width: pct(grant, total) + "%" },
      },
        el("div", { class: "use", style: { width: pct(used, grant) + "%" } }),
        el("span", { class: "seg-label", text: name }));
      bar.append(segment);
    }
    const others = Math.max(0, (gpu.memory_reserved || 0) - known);
    if (others > 0) {
      bar.append(el("div", { class: "seg other", title: "other grants: " + bytes(others),
        style: { width: pct(others, total) + "%" } }));
    }
    const burst = gpu.memory_burst || 0;  // bursters' use above their grants: taken, though no grant holds it
    if (burst > 0) {
      bar.append(el("div", { class: "seg burst", title: "burst above grants: " + bytes(burst),
        style: { width: pct(burst, total) + "%" } }));
    }
    const held = gpu.memory_reserved_for_gang || 0;  // held for a waiting gang: nothing else may take it
    if (held > 0) {
      bar.append(el("div", { class: "seg gang-hold", title: "held for a waiting gang: " + bytes(held),
        style: { width: pct(held, total) + "%" } }));
    }
    const unmanaged = gpu.memory_unmanaged || 0;
    if (unmanaged > 0) {
      bar.append(el("div", { class: "seg unmanaged", title: "unmanaged: " + bytes(unmanaged),
        style: { width: pct(unmanaged, total) + "%" } }));
    }
    const headroom = gpu.memory_headroom || 0;
    if (headroom > 0) {
      bar.append(el("div", { class: "seg headroom", title: "headroom: " + bytes(headroom),
        style: { width: pct(headroom, total) + "%" } }));
    }
    const free = Math.max(0, gpu.memory_free || 0);
    bar.append(el("div", { class: "seg free", title: "free: " + bytes(free), style: { width: pct(free, total) + "%" } }));

    const sick = gpu.healthy === false;
    const title = el("div", { class: "gpu-head" },
      el("span", { class: "gpu-name", text: "GPU " + gpu.index + " · " + (gpu.name || "") }),
      sick ? el("span", { class: "badge down", "data-gpu-health": "unhealthy", title: gpu.health || "",
        text: "unhealthy: " + (gpu.health || "") }) : null,
      gpu.topology ? el("span", { class: "muted", text: "NVLink group " + gpu.topology.nvlink }) : null,
      el("span", { class: "muted gpu-uuid", text: gpu.uuid }));
    const figures = el("div", { class: "gpu-figures" },
      figure("used", gpu.memory_used), figure("granted", gpu.memory_reserved),
      burst ? el("span", { class: "fig", "data-memory-burst": burst, title: "what bursters use above their grants" },
        el("span", { class: "muted", text: "burst " }), bytes(burst)) : null,
      held ? el("span", { class: "fig", "data-memory-reserved-for-gang": held,
        title: "held for the gang that waited longest: it starts once every member fits" },
        el("span", { class: "muted", text: "held for a gang " }), bytes(held)) : null,
      unmanaged ? figure("unmanaged", unmanaged) : null, figure("free", free), figure("total", total),
      gpu.mps ? el("span", { class: "fig", "data-compute-shares": gpu.compute_shares || 0,
        title: "MPS: the compute shares of its grants, in percent of its SMs (at most 100)" },
        el("span", { class: "muted", text: "SM shares " }), (gpu.compute_shares || 0) + "%") : null);
    return el("div", { class: "gpu" + (sick ? " is-unhealthy" : ""), "data-gpu": gpu.uuid }, title, bar, figures);
  }

  function figure(label, value) {
    return el("span", { class: "fig" }, el("span", { class: "muted", text: label + " " }), bytes(value));
  }

  // usage on one GPU: the API sums it over a container's GPUs, so a multi-GPU one is shown evenly split
  function perGpuUse(c) {
    return (c.gpu_memory_used || 0) / Math.max(1, c.gpu_count || 1);
  }

  // each account's allocation against its fair share (bytes × GPUs): the bar fills to what it holds,
  // red past its share, and the line marks the share; the scale is the larger of the two and its request
  function renderAccounts() {
    const rows = state.accounts.map((a) => {
      const fair = a.fair_share || 0;
      const held = a.allocated || 0;
      const scale = Math.max(fair, held, a.requested || 0);
      const bar = el("div", { class: "bar share-bar", role: "img", "aria-label": "allocated against fair share" },
        el("div", { class: "seg grant" + (held > fair ? " over" : ""), style: { width: pct(held, scale) + "%" } }),
        el("div", { class: "fair-mark", style: { left: pct(fair, scale) + "%" } }));
      return el("tr", { "data-account": a.name, title: (a.parent ? "in " + a.parent + ", " : "") + "weight " +
        a.over_quota_weight + ", priority " + a.priority },
        el("td", { class: "name", text: a.name }),
        el("td", { class: "num", text: bytes(a.quota && a.quota.gpu_memory) }),
        el("td", { class: "num", "data-fair-share": fair, text: bytes(fair) }),
        el("td", { class: "num", "data-allocated": held, text: bytes(held) }),
        el("td", {}, bar),
        el("td", { class: "num", text: bytes(a.waiting || 0) }));
    });
    $("accounts-body").replaceChildren(...rows);
    $("accounts-section").hidden = rows.length === 0;
    $("accounts-count").textContent = rows.length ? "(" + rows.length + ")" : "";
  }

  function renderContainers() {
    const live = state.containers.filter((c) => LIVE.has(c.state));
    const ended = state.containers
      .filter((c) => !LIVE.has(c.state) && c.state !== "queued")
      .sort((a, b) => (b.finished_at || b.created_at || 0) - (a.finished_at || a.created_at || 0))
      .slice(0, ENDED_SHOWN);
    const rows = [...live, ...ended].map(containerRow);
    $("containers-body").replaceChildren(...rows);
    $("containers-empty").hidden = rows.length > 0;
    $("containers-wrap").hidden = rows.length === 0;
    $("containers-count").textContent = live.length ? "(" + live.length + " live)" : "";
  }

  function containerRow(c) {
    const grant = (c.gpu_memory || 0) * Math.max(1, c.gpu_count || 1);
    const used = c.gpu_memory_used || 0;
    const isLive = LIVE.has(c.state);
    const limit = Math.max(c.gpu_memory || 0, c.gpu_memory_limit || 0) * Math.max(1, c.gpu_count || 1);
    const ratio = grant > 0 ? used / grant : 0;
    const overLimit = limit > 0 ? used / limit : 0;  // "over" means over what it may use: a burster's limit
    const where = c.node
      ? c.node + " / " + ((c.gpus || []).map((g) => (g.index === null || g.index === undefined ? "?" : g.index)).join(",") || "–")
      : "–";
    const share = el("td", { class: "num share" }, grant && isLive ? Math.round(100 * ratio) + "%" : "–");
    if (isLive && overLimit > 1) share.append(" ", el("span", { class: "mark over", "data-mark": "over",
      text: limit > grant ? "over limit" : "over grant" }));
    else if (isLive && limit > grant && ratio > 1) share.append(" ", el("span", { class: "mark near",
      "data-mark": "burst", text: "bursting" }));
    else if (isLive && overLimit >= NEAR) share.append(" ", el("span", { class: "mark near", "data-mark": "near",
      text: "near grant" }));
    const stateCell = el("td", {}, el("span", { class: "state s-" + c.state, text: c.state }));
    const overrun = c.detail && c.detail.overrun;
    if (overrun && overrun.observed !== undefined) {
      stateCell.append(el("div", { class: "muted small",
        text: "observed " + bytes(overrun.observed) + " of grant " + bytes(overrun.grant_bytes) }));
    } else if (!isLive && c.reason) {
      stateCell.append(el("div", { class: "muted small reason", text: c.reason }));
    }
    const name = el("td", { class: "name", text: c.name || "–" });
    if (c.gang) name.append(el("div", { class: "muted small", "data-gang": c.gang, "data-rank": c.rank,
      title: "a member of gang " + c.gang + ": placed, and ended, with the others", text: "gang " + shortId(c.gang) +
        " · rank " + c.rank }));
    return el("tr", { "data-container": c.id, "data-state": c.state, class: isLive ? "" : "ended" },
      name,
      el("td", { class: "mono", title: c.id, text: shortId(c.id) }),
      el("td", { text: c.tenant || "–" }),
      el("td", { text: where }),
      stateCell,
      el("td", { class: "num", "data-limit": limit > grant ? limit : 0,
        text: bytes(grant) + (c.gpu_count > 1 ? " (" + c.gpu_count + "×)" : "") + (limit > grant ? " ↑ " + bytes(limit) : "") }),
      el("td", { class: "num", "data-compute-share": c.compute_share || 0,
        text: c.compute_share ? c.compute_share + "%" : "–" }),
      el("td", { class: "num", text: isLive ? bytes(used) : "–" }),
      el("td", { class: "num", text: bytes(c.gpu_memory_peak || 0) }),
      share);
  }

  function renderQueue() {
    const queued = state.containers
      .filter((c) => c.state === "queued")
      .sort((a, b) => ((a.queue && a.queue.position) || 0) - ((b.queue && b.queue.position) || 0));
    const rows = queued.map((c) => {
      const q = c.queue || {};
      return el("tr", { "data-queued": c.id },
        el("td", { class: "num", text: q.position === undefined ? "–" : q.position }),
        el("td", { class: "name", text: c.name || shortId(c.id) }),
        el("td", { text: c.tenant || "–" }),
        el("td", { class: "num", text: c.priority }),
        el("td", { class: "num", title: q.effective_priority, text: Number.isFinite(q.effective_priority)
          ? String(Math.round(q.effective_priority * 10) / 10) : "–" }),
        el("td", { class: "num", "data-waited-since": c.queued_at || "", text: ago(q.waited) }),
        el("td", { class: "num", text: bytes(c.gpu_memory) + (c.gpu_count > 1 ? " × " + c.gpu_count : "") +
          (q.making_room && q.making_room.length ? " · making room" : "") }));
    });
    $("queue-body").replaceChildren(...rows);
    $("queue-empty").hidden = rows.length > 0;
    $("queue-wrap").hidden = rows.length === 0;
    $("queue-count").textContent = rows.length ? "(" + rows.length + ")" : "";
  }

  function renderEvents(byId) {
    const items = state.events.slice().reverse().map((e) => {
      const bad = e.type === "killed" || e.type === "overrun";
      const c = e.container ? byId.get(e.container) : null;
      const who = c ? c.name || shortId(c.id) : e.container ? shortId(e.container) : "";
      const li = el("li", { class: "event t-" + e.type + (bad ? " bad" : ""), "data-event": e.id, "data-type": e.type },
        el("time", { class: "muted mono", text: clock(e.time) }),
        el("span", { class: "etype", text: e.type }),
        who ? el("span", { class: "ewho", text: who }) : null,
        e.node ? el("span", { class: "muted", text: "@" + e.node }) : null,
        el("span", { class: "emsg", text: e.message || "" }));
      // an overrun event carries the figures itself; the kill that ends it carries them under "overrun"
      const figure = e.observed !== undefined ? e : e.overrun;
      if (bad && figure && figure.observed !== undefined) {
        li.append(el("strong", { class: "efigure",
          text: "observed " + bytes(figure.observed) + " of grant " + bytes(figure.grant_bytes) }));
      }
      return li;
    });
    $("events").replaceChildren(...items);
    $("events-empty").hidden = items.length > 0;
  }

  // relative times move every second even when the data does not
  function renderTimes() {
    const now = Date.now() / 1000;
    for (const node of document.querySelectorAll("[data-last-seen]")) {
      const seen = Number(node.getAttribute("data-last-seen"));
      node.textContent = seen ? "last seen " + ago(now - seen) + " ago" : "never seen";
    }
  }

  // ---- wiring -----------------------------------------------------------------------------------
  function start() {
    setToken(token());
    $("login-form").addEventListener("submit", (event) => {
      event.preventDefault();
      const value = $("token-input").value.trim();
      if (!value) return;
      setToken(value);
      $("token-input").value = "";
      state.needToken = false;
      setStatus("checking token…", "connecting");
      poll();
    });
    $("forget-token").addEventListener("click", () => {
      setToken("");
      state.signature = "";
      state.nodes = [];
      state.nodesByName = new Map();
      state.nodesVersion = ""; // issue 20
      state.containers = [];
      state.accounts = [];
      state.events = [];
      state.lastEventId = 0;
      render();
      begin(); // a manager with a token gets the form back, asked of /healthz
    });
    setInterval(() => {
      renderTimes();
      if (!state.needToken && state.lastOk && Date.now() / 1000 - state.lastOk > 5) {
        setStatus("stale: last update " + ago(Date.now() / 1000 - state.lastOk) + " ago", "error");
      }
    }, 1000);
    begin();
  }

  // Without a kept token, ask the open /healthz whether the API wants one, and show the form before
  // any call could be refused: a refused fetch is a console error in the browser.
  async function begin() {
    clearTimeout(state.timer);
    state.timer = null;
    if (!token()) {
      try {
        const health = await (await fetch("/healthz", { cache: "no-store" })).json();
        if (health && health.token_required) {
          askForToken(false);
          return;
        }
      } catch (_) {
        /* the poll below reports an unreachable manager */
      }
    }
    poll();
  }

  if (document.readyState === "loading") document.addEventListener("DOMContentLoaded", start);
  else start();
})();
