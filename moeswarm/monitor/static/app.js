// The swarm map: polls /api/v1/swarm every few seconds and redraws, without reloading the page.
// Plain ES module, no build step, no third-party code.

const POLL_MS = 2000;
/** @type {Map<string, {view: string, zoom: number}>} per model: what the map shows and at what cell size */
const views = new Map();
let last = null;

/** @param {number} n live replicas of one expert -> its cell colour (0 is red) */
function replicaColour(n) {
  if (n <= 0) return "#d62d20";
  if (n === 1) return "#f2c14e";
  if (n === 2) return "#9bd08b";
  return "#2e8b3e";
}

/** @param {number} v demand share relative to the layer's maximum, 0..1 -> a blue ramp */
function demandColour(v) {
  const t = Math.max(0, Math.min(1, v));
  const c = Math.round(240 - 200 * t);
  return `rgb(${c}, ${Math.round(245 - 150 * t)}, 255)`;
}

function shortId(id) { return id.length > 16 ? `${id.slice(0, 6)}…${id.slice(-6)}` : id; }

function el(tag, attrs = {}, ...children) {
  const e = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs)) {
    if (k === "class") e.className = v; else if (k === "text") e.textContent = v; else e.setAttribute(k, v);
  }
  for (const c of children) e.append(c);
  return e;
}

/** @param {number} zoom cell size in px, @param {number} minPx room a label needs -> label every n-th cell (1, 2, 4, ...) */
function tickStep(zoom, minPx) {
  let step = 1;
  while (step * zoom < minPx) step *= 2;
  return step;
}

/** Layer numbers down the left of the map and expert numbers along its top, at the cells' positions. */
function drawAxes(box, model, zoom) {
  const xAxis = box.querySelector(".axis-x"), yAxis = box.querySelector(".axis-y");
  const E = model.num_experts, L = model.moe_layers.length;
  xAxis.style.width = `${E * zoom}px`; yAxis.style.height = `${L * zoom}px`;
  const xStep = tickStep(zoom, 22), yStep = tickStep(zoom, 14);
  const xs = [], ys = [];
  for (let e = 0; e < E; e += xStep) {
    const t = el("span", { class: "tick", "data-expert": String(e), text: String(e) });
    t.style.left = `${e * zoom}px`; t.style.width = `${Math.max(zoom, 1)}px`;
    xs.push(t);
  }
  for (let i = 0; i < L; i += yStep) {
    const t = el("span", { class: "tick", "data-layer": String(model.moe_layers[i]), text: String(model.moe_layers[i]) });
    t.style.top = `${i * zoom}px`; t.style.height = `${Math.max(zoom, 1)}px`; t.style.lineHeight = `${Math.max(zoom, 1)}px`;
    ys.push(t);
  }
  xAxis.replaceChildren(...xs);
  yAxis.replaceChildren(...ys);
}

/** What a person calls the model: its name (from config.json, or the folder's), and its family. */
function modelLabel(model) { return model && model.name ? `${model.name} (${model.arch})` : (model ? model.arch : ""); }

function drawMap(canvas, model, view, zoom) {
  const L = model.moe_layers.length, E = model.num_experts;
  canvas.width = E * zoom; canvas.height = L * zoom;
  const ctx = canvas.getContext("2d");
  const demand = model.demand;
  for (let i = 0; i < L; i++) {
    const rowMax = demand ? Math.max(...demand[i]) || 1 : 1;
    for (let e = 0; e < E; e++) {
      ctx.fillStyle = view === "demand" && demand ? demandColour(demand[i][e] / rowMax) : replicaColour(model.coverage[i][e]);
      ctx.fillRect(e * zoom, i * zoom, zoom - (zoom > 3 ? 1 : 0), zoom - (zoom > 3 ? 1 : 0));
    }
  }
  canvas.dataset.uncovered = String(model.uncovered_experts);
}

function renderModels(snap) {
  const root = document.getElementById("models");
  const seen = new Set();
  for (const model of snap.models) {
    seen.add(model.model_id);
    let box = root.querySelector(`[data-model="${CSS.escape(model.model_id)}"]`);
    if (!box) {
      box = el("div", { class: "model", "data-model": model.model_id });
      box.append(el("div", { class: "model-head" }), el("div", { class: "map-tools" }), el("div", { class: "map-wrap" },
        el("div", { class: "map-grid" },
          el("div", { class: "axis-corner muted", text: "layer ↓ expert →" }), el("div", { class: "axis-x", "aria-label": "experts" }),
          el("div", { class: "axis-y", "aria-label": "MoE layers" }), el("canvas"))));
      const tools = box.querySelector(".map-tools");
      const select = el("select", { "aria-label": "map view" },
        el("option", { value: "replicas", text: "live replicas" }), el("option", { value: "demand", text: "demand" }));
      const minus = el("button", { text: "−", title: "smaller cells" });
      const plus = el("button", { text: "+", title: "bigger cells" });
      tools.append("view ", select, " zoom ", minus, plus,
        el("span", { class: "legend" }, el("i", { style: "background:#d62d20" }), "0", el("i", { style: "background:#f2c14e" }), "1",
          el("i", { style: "background:#9bd08b" }), "2", el("i", { style: "background:#2e8b3e" }), "3+"));
      const cells = Math.max(model.num_experts, model.moe_layers.length);
      views.set(model.model_id, { view: "replicas", zoom: Math.max(4, Math.min(24, Math.floor(900 / cells))) });
      select.addEventListener("change", () => { views.get(model.model_id).view = select.value; render(); });
      minus.addEventListener("click", () => { const v = views.get(model.model_id); v.zoom = Math.max(2, v.zoom - 2); render(); });
      plus.addEventListener("click", () => { const v = views.get(model.model_id); v.zoom = Math.min(48, v.zoom + 2); render(); });
      box.querySelector("canvas").addEventListener("mousemove", (ev) => hover(ev, model.model_id));
      box.querySelector("canvas").addEventListener("mouseleave", () => { document.getElementById("tooltip").hidden = true; });
      root.append(box);
    }
    const head = box.querySelector(".model-head");
    head.replaceChildren(
      el("strong", { class: "model-name", text: modelLabel(model) }),
      el("code", { class: "model-id muted", title: "model id in the swarm", text: model.model_id }),
      el("span", { class: `verdict ${model.verdict}`, "data-verdict": model.verdict, text: model.verdict }),
      el("span", { text: `${model.holders_live}/${model.holders} holders live` }),
      el("span", { text: `${model.replicas_live}/${model.replicas_total} replicas live` }),
      el("span", { text: `${model.uncovered_experts} experts uncovered` }),
      el("span", { text: `${model.tokens_per_s} tokens/s served recently` }),
      el("span", { class: "muted", text: `${model.moe_layers.length} MoE layers × ${model.num_experts} experts, top-${model.top_k}` }));
    const v = views.get(model.model_id);
    drawMap(box.querySelector("canvas"), model, v.view, v.zoom);
    drawAxes(box, model, v.zoom);
  }
  for (const box of root.querySelectorAll(".model")) if (!seen.has(box.dataset.model)) box.remove();
}

function hover(ev, modelId) {
  if (!last) return;
  const model = last.models.find((m) => m.model_id === modelId);
  const tip = document.getElementById("tooltip");
  if (!model) { tip.hidden = true; return; }
  const zoom = views.get(modelId).zoom;
  const rect = ev.target.getBoundingClientRect();
  const e = Math.floor((ev.clientX - rect.left) / zoom), i = Math.floor((ev.clientY - rect.top) / zoom);
  if (i < 0 || e < 0 || i >= model.moe_layers.length || e >= model.num_experts) { tip.hidden = true; return; }
  const parts = [`layer ${model.moe_layers[i]}, expert ${e}`, `live replicas: ${model.coverage[i][e]}`];
  if (model.demand) parts.push(`demand share: ${(100 * model.demand[i][e]).toFixed(3)}%`);
  if (model.prices) parts.push(`price: ${model.prices[i][e].toFixed(3)}x`);
  tip.textContent = parts.join(" · ");
  tip.style.left = `${ev.clientX + 12}px`; tip.style.top = `${ev.clientY + 12}px`; tip.hidden = false;
}

/** @param {number[]} b one announced block: [first layer, last layer, first expert, last expert] */
function blockText(b) { return `${b[0]}-${b[1]} × ${b[2]}-${b[3]}`; }

/** Every block a node announced: a bar of the expert ranges it covers, then each block in words. */
function holdings(node, model) {
  const blocks = node.blocks && node.blocks.length ? node.blocks : [[...node.layers, ...node.experts]];
  const bar = el("div", { class: "bar", title: blocks.map((b) => `layers ${b[0]}-${b[1]}, experts ${b[2]}-${b[3]}`).join("; ") });
  if (model) {
    const E = model.num_experts;
    for (const b of blocks) {
      const span = el("span");
      span.style.left = `${(100 * b[2]) / E}%`;
      span.style.width = `${(100 * (b[3] - b[2] + 1)) / E}%`;
      bar.append(span);
    }
  }
  const list = el("div", { class: "blocks" }, ...blocks.map((b) => el("span", { class: "block", "data-block": b.join(","), text: blockText(b) })));
  return [bar, list];
}

function renderNodes(snap) {
  const body = document.querySelector("#nodes tbody");
  const models = new Map(snap.models.map((m) => [m.model_id, m]));
  body.replaceChildren(...snap.nodes.map((n) => {
    const status = n.status_url ? el("a", { href: `${n.status_url}/status`, text: "status" }) : el("span", { class: "muted", text: "—" });
    const row = el("tr", { "data-peer": n.peer_id, "data-state": n.state },
      el("td", { class: "peer", title: n.peer_id, "data-peer-id": n.peer_id, text: shortId(n.peer_id) }),
      el("td", { title: n.model_id, text: modelLabel(models.get(n.model_id)) || shortId(n.model_id) }),
      el("td", { class: "holds" }, ...holdings(n, models.get(n.model_id))),
      el("td", { class: `state-${n.state}` }, n.state, ...(n.error ? [el("div", { class: "reason", text: n.error })] : [])),
      el("td", { text: n.via }),
      el("td", { text: n.software || "—" }),
      el("td", { text: `${(n.load_permille / 10).toFixed(1)}%` }),
      el("td", { text: n.rtt_ms == null ? "—" : `${n.rtt_ms.toFixed(2)} ms` }),
      el("td", { text: n.calls_served == null ? "—" : String(n.calls_served) }),
      el("td", {}, status));
    return row;
  }));
}

function renderContributors(snap) {
  const section = document.getElementById("contributors-section");
  section.hidden = !snap.contributors;
  if (!snap.contributors) return;
  document.querySelector("#contributors tbody").replaceChildren(...snap.contributors.map((c, i) =>
    el("tr", {}, el("td", { text: String(i + 1) }), el("td", { class: "peer", title: c.peer_id, text: shortId(c.peer_id) }),
      el("td", { text: Number(c.credit).toLocaleString() }))));
}

function render() {
  if (!last) return;
  renderModels(last);
  renderNodes(last);
  renderContributors(last);
  const updated = document.getElementById("updated");
  let text = `updated ${new Date(last.generated_at_ms).toLocaleTimeString()} · crawl round ${last.rounds}`;
  if (last.catalogue) {  // watching the swarm's catalogue (no --model): say what it dropped
    const dropped = Object.entries(last.catalogue.rejected).sort().map(([reason, n]) => `${reason} ${n}`);
    text += ` · ${last.models.length} models from the catalogue`;
    if (dropped.length) text += ` · dropped: ${dropped.join(", ")}`;
  }
  updated.textContent = text;
  document.body.dataset.rounds = String(last.rounds);
}

async function poll() {
  try {
    const response = await fetch("/api/v1/swarm", { cache: "no-store" });
    if (response.ok) { last = await response.json(); render(); }
  } catch (err) {
    document.getElementById("updated").textContent = `monitor unreachable: ${err}`;
  }
  setTimeout(poll, POLL_MS);
}

poll();
