"""The dashboard's single page: HTML, CSS and plain JavaScript drawing SVG charts (no CDN, works offline).

Guarantees: it only GETs /api/state and /api/jobs/{id} (every 2 s), and renders text with
textContent (never innerHTML of served data), so a completion's text cannot script the page.
"""

PAGE = """<!doctype html>
<html lang="en"><head><meta charset="utf-8"><title>dockyard</title>
<style>
body{font:14px system-ui,sans-serif;margin:16px;color:#222;background:#fafafa}
h1{font-size:20px;margin:0 0 8px} h2{font-size:16px;margin:18px 0 6px}
table{border-collapse:collapse;background:#fff} td,th{border:1px solid #ddd;padding:3px 8px;text-align:left}
tr.job{cursor:pointer} tr.sel{background:#e8f0fe}
#charts{display:grid;grid-template-columns:repeat(auto-fill,minmax(330px,1fr));gap:10px}
.chart{background:#fff;border:1px solid #ddd;padding:6px} .chart h3{font-size:13px;margin:0 0 4px}
.warn{color:#a40} .muted{color:#777} pre{white-space:pre-wrap;margin:0;max-width:60ch}
</style></head><body>
<h1>dockyard</h1><div class="muted" id="updated">loading…</div>
<h2>Jobs</h2><table id="jobs"><thead><tr><th>job</th><th>state</th><th>step</th><th>phase</th>
<th>reward</th><th>val pass</th></tr></thead><tbody></tbody></table>
<h2 id="jobtitle">Curves</h2><div id="charts"></div>
<h2>Fleet</h2><table id="fleet"><thead><tr><th>member</th><th>kind</th><th>status</th><th>address</th>
<th>load</th><th>in flight</th><th>weight versions</th></tr></thead><tbody></tbody></table>
<h2>Recent samples</h2><table id="samples"><thead><tr><th>step</th><th>reward</th><th>verdict</th>
<th>prompt</th><th>completion</th></tr></thead><tbody></tbody></table>
<script>
"use strict";
const CHARTS = [
  ["reward", "train", ["reward_mean"]],
  ["validation pass rate", "validation", ["pass_rate"]],
  ["loss", "train", ["loss", "pg_loss"]],
  ["KL", "train", ["kl", "gen_train_kl"]],
  ["entropy", "train", ["entropy"]],
  ["clip fraction", "train", ["clip_fraction", "dual_clip_fraction"]],
  ["tokens/s", "train", ["generated_tokens_per_second", "tokens_per_second"]],
];
const COLORS = ["#1f77b4", "#d62728", "#2ca02c", "#9467bd"];
let selected = null;
const SVG = "http://www.w3.org/2000/svg";

function el(tag, attrs, text) {
  const e = tag.startsWith("svg:") ? document.createElementNS(SVG, tag.slice(4)) : document.createElement(tag);
  for (const [k, v] of Object.entries(attrs || {})) e.setAttribute(k, v);
  if (text !== undefined) e.textContent = String(text);
  return e;
}
function fmt(v) { return v === undefined || v === null ? "-" : (Math.abs(v) >= 100 ? v.toFixed(0) : v.toFixed(3)); }

function lineChart(title, series) {
  const W = 320, H = 160, L = 46, R = 8, T = 8, B = 22;
  const box = el("div", {class: "chart", "data-title": title});
  box.append(el("h3", {}, title));
  const pts = series.flatMap(s => s.points);
  const svg = el("svg:svg", {width: W, height: H, viewBox: `0 0 ${W} ${H}`});
  if (!pts.length) { box.append(el("div", {class: "muted"}, "no data yet")); return box; }
  const xs = pts.map(p => p[0]), ys = pts.map(p => p[1]);
  let x0 = Math.min(...xs), x1 = Math.max(...xs), y0 = Math.min(...ys), y1 = Math.max(...ys);
  if (x1 === x0) x1 = x0 + 1; if (y1 === y0) { y0 -= 0.5; y1 += 0.5; }
  const sx = x => L + (x - x0) / (x1 - x0) * (W - L - R), sy = y => H - B - (y - y0) / (y1 - y0) * (H - T - B);
  svg.append(el("svg:line", {x1: L, y1: H - B, x2: W - R, y2: H - B, stroke: "#999"}));
  svg.append(el("svg:line", {x1: L, y1: T, x2: L, y2: H - B, stroke: "#999"}));
  for (const y of [y0, y1]) svg.append(el("svg:text", {x: 2, y: sy(y) + 4, "font-size": 10}, fmt(y)));
  const step = Math.max(1, Math.ceil((x1 - x0) / 6));  // integer steps on the x axis
  for (let x = Math.ceil(x0); x <= x1; x += step)
    svg.append(el("svg:text", {x: sx(x) - 4, y: H - 6, "font-size": 10}, x));
  series.forEach((s, i) => {
    if (!s.points.length) return;
    const d = s.points.map((p, j) => `${j ? "L" : "M"}${sx(p[0]).toFixed(1)},${sy(p[1]).toFixed(1)}`).join(" ");
    svg.append(el("svg:path", {d, fill: "none", stroke: COLORS[i % COLORS.length], "stroke-width": 1.5,
                               class: "series", "data-name": s.name, "data-points": s.points.length}));
  });
  box.append(svg);
  const legend = el("div", {class: "muted"});  // below the plot, never over the data
  series.filter(s => s.points.length).forEach((s, i) => {
    const item = el("span", {style: `color:${COLORS[i % COLORS.length]};margin-right:10px`}, "— " + s.name);
    legend.append(item);
  });
  box.append(legend);
  return box;
}

function barChart(title, bars) {
  const W = 320, H = 160, B = 22, T = 8;
  const box = el("div", {class: "chart", "data-title": title});
  box.append(el("h3", {}, title));
  if (!bars.length) { box.append(el("div", {class: "muted"}, "no data yet")); return box; }
  const svg = el("svg:svg", {width: W, height: H});
  const top = Math.max(...bars.map(b => b[1]), 1), w = (W - 20) / bars.length;
  bars.forEach(([label, v], i) => {
    const h = v / top * (H - T - B - 12);  // room for the value above the tallest bar
    const x = 10 + i * w + 2;
    svg.append(el("svg:rect", {x, y: H - B - h, width: w - 4, height: h, fill: COLORS[0], class: "bar"}));
    svg.append(el("svg:text", {x: 10 + i * w + w / 2 - 10, y: H - 6, "font-size": 10}, label));
    svg.append(el("svg:text", {x: 10 + i * w + w / 2 - 6, y: H - B - h - 2, "font-size": 10}, v));
  });
  box.append(svg);
  return box;
}

function renderJob(data) {
  const recs = data.records;
  const job = data.job;
  document.getElementById("jobtitle").textContent = `Curves: ${job.job_id} (step ${job.step}/${job.max_steps})`;
  const charts = document.getElementById("charts");
  charts.replaceChildren();
  for (const [title, kind, keys] of CHARTS) {
    const series = keys.map(k => ({name: k, points: recs.filter(r => r.kind === kind && typeof r[k] === "number")
                                                        .map(r => [r.step, r[k]])}));
    charts.append(lineChart(title, series));
  }
  const last = recs.filter(r => r.kind === "train").slice(-1)[0] || {};
  const ages = Object.keys(last).filter(k => /^staleness_\\d+$/.test(k))
    .map(k => [+k.slice(10), last[k]]).sort((a, b) => a[0] - b[0]).map(([a, v]) => ["age " + a, v]);
  charts.append(barChart("staleness of the last step's samples", ages));
  const tbody = document.querySelector("#samples tbody");
  tbody.replaceChildren();
  for (const s of data.samples.slice().reverse()) {
    const tr = el("tr");
    for (const v of [s.step, fmt(s.reward), s.verdict, s.prompt, s.completion]) {
      const td = el("td"); td.append(el("pre", {}, v === undefined ? "" : v)); tr.append(td);
    }
    tbody.append(tr);
  }
}

async function refresh() {
  try {
    const state = await (await fetch("api/state")).json();
    const tbody = document.querySelector("#jobs tbody");
    tbody.replaceChildren();
    // Jobs come newest first: follow a running one, else the newest (a recovered store holds old ones).
    if (!selected && state.jobs.length)
      selected = (state.jobs.find(j => j.state === "RUNNING") || state.jobs[0]).job_id;
    for (const j of state.jobs) {
      const tr = el("tr", {class: "job" + (j.job_id === selected ? " sel" : ""), "data-job": j.job_id});
      for (const v of [j.job_id, j.state, `${j.step}/${j.max_steps}`, j.phase, fmt(j.metrics.reward_mean),
                       fmt(j.validation.pass_rate)]) tr.append(el("td", {}, v));
      tr.onclick = () => { selected = j.job_id; refresh(); };
      tbody.append(tr);
    }
    const fleet = document.querySelector("#fleet tbody");
    fleet.replaceChildren();
    for (const m of state.fleet) {
      const versions = Object.entries(m.weight_versions).map(([j, v]) => `${j}@${v}`).join(", ");
      const tr = el("tr");
      for (const v of [m.name, m.kind, m.status, m.address, m.load, m.in_flight, versions]) tr.append(el("td", {}, v));
      fleet.append(tr);
    }
    if (selected) renderJob(await (await fetch("api/jobs/" + encodeURIComponent(selected))).json());
    document.getElementById("updated").textContent = "updated " + new Date().toLocaleTimeString();
  } catch (err) {
    document.getElementById("updated").textContent = "cannot reach the coordinator: " + err;
  }
}
refresh();
setInterval(refresh, 2000);
</script></body></html>
"""
