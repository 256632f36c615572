// The built-in page: live weights table, weight-history chart (uPlot, served from /static/vendor),
// sampled picker decisions. Reads only this server's admin API. Query string: ?cluster=&since=.
"use strict";

const COLORS = ["#1f77b4", "#d62728", "#2ca02c", "#9467bd", "#ff7f0e", "#17becf", "#8c564b", "#e377c2",
                "#7f7f7f", "#bcbd22"];
const params = new URLSearchParams(location.search);
let chart = null;
let chartKey = "";
let chartHealth = [];

function fmt(v, digits = 0, scale = 1) {
  return v === null || v === undefined ? "–" : (v * scale).toFixed(digits);
}

function cell(row, text, cls) {
  const td = row.insertCell();
  td.textContent = text;
  if (cls) td.className = cls;
}

async function getJSON(url) {
  const r = await fetch(url, {cache: "no-store"});
  const body = await r.json();
  if (!r.ok) throw new Error((body.error && body.error.message) || r.statusText);
  return body;
}

async function refreshWeights() {
  const doc = await getJSON("/api/v1/weights");
  const src = doc.metrics_source || {};
  document.getElementById("status").textContent =
    `snapshot ${doc.snapshot_version || "–"} · metrics source ${src.name} ${src.ok ? "ok" : "FAILING"}`;
  const body = document.querySelector("#weights tbody");
  body.replaceChildren();
  const select = document.getElementById("cluster");
  for (const c of doc.clusters) {
    if (![...select.options].some(o => o.value === c.name)) select.add(new Option(c.name, c.name));
    for (const e of c.endpoints) {
      const i = e.inputs || {};
      const row = body.insertRow();
      cell(row, c.name);
      cell(row, e.address);
      cell(row, e.weight, "num");
      cell(row, e.health, e.health);
      cell(row, fmt(e.score, 2), "num");
      cell(row, fmt(i.latency_mean_ms), "num");
      cell(row, fmt(i.latency_p95_ms), "num");
      cell(row, fmt(i.running, 1), "num");
      cell(row, fmt(i.queue, 1), "num");
      cell(row, fmt(i.gpu_util, 0, 100), "num");
      cell(row, fmt(i.kv_cache, 0, 100), "num");
      cell(row, fmt(i.sample_age_s, 1), "num");
      cell(row, (e.reasons || []).join("; "), "reason");
    }
  }
}

// History series -> uPlot's aligned data: x = every point time plus `until` (so each step line
// reaches the present); y per series = its weight at its own points, null elsewhere (spanGaps
// joins them with steps).
function alignedData(doc) {
  const times = new Set([doc.until]);
  for (const s of doc.series) for (const p of s.points) times.add(p.t);
  const xs = [...times].sort((a, b) => a - b);
  const index = new Map(xs.map((t, i) => [t, i]));
  const ys = [];
  const health = [];
  for (const s of doc.series) {
    const y = new Array(xs.length).fill(null);
    const h = new Array(xs.length).fill(null);
    for (const p of s.points) {
      y[index.get(p.t)] = p.weight;
      h[index.get(p.t)] = p.health;
    }
    const last = s.points[s.points.length - 1];
    if (last && y[xs.length - 1] === null) {
      y[xs.length - 1] = last.weight;
      h[xs.length - 1] = last.health;
    }
    ys.push(y);
    health.push(h);
  }
  return {data: [xs, ...ys], health};
}

function drawChart(doc) {
  const labels = doc.series.map(s => `${s.endpoint} (${s.cluster})`);
  const {data, health} = alignedData(doc);
  chartHealth = health;
  const key = labels.join("|");
  const el = document.getElementById("chart");
  if (chart && key === chartKey) {
    chart.setData(data);
  } else {
    if (chart) chart.destroy();
    chartKey = key;
    chart = new uPlot({
      width: Math.max(400, el.clientWidth || 900),
      height: 320,
      scales: {y: {range: (u, min, max) => [0, Math.max(1, max) * 1.1]}},
      axes: [{}, {label: "EDS weight"}],
      series: [{}, ...labels.map((label, i) => ({
        label,
        stroke: COLORS[i % COLORS.length],
        width: 2,
        spanGaps: true,
        paths: uPlot.paths.stepped({align: 1}),
        points: {show: true, size: 5},
        value: (u, v, si, idx) => v === null ? "–" : `${v} ${chartHealth[si - 1][idx] || ""}`,
      }))],
    }, data, el);
  }
  document.getElementById("chart-state").textContent = JSON.stringify({
    labels: chart.series.slice(1).map(s => s.label),
    data: chart.data,
    until: doc.until,
  });
  const n = doc.series.reduce((a, s) => a + s.points.length, 0);
  document.getElementById("history-note").textContent =
    `${doc.series.length} endpoints, ${n} points${doc.truncated ? " (truncated: pick a shorter range)" : ""}`;
}

async function refreshHistory() {
  const q = new URLSearchParams({since: document.getElementById("since").value});
  const cluster = document.getElementById("cluster").value;
  if (cluster) q.set("cluster", cluster);
  drawChart(await getJSON(`/api/v1/history?${q}`));
}

async function refreshDecisions() {
  const doc = await getJSON("/api/v1/decisions?limit=15");
  const body = document.querySelector("#decisions tbody");
  body.replaceChildren();
  for (const d of doc.decisions) {
    const row = body.insertRow();
    cell(row, new Date(d.at * 1000).toLocaleTimeString());
    cell(row, d.session || "–");
    cell(row, d.version || "(default)");
    cell(row, d.cluster || "–");
    cell(row, d.endpoint || "(weighted)");
    cell(row, d.reason);
    cell(row, d.status || "", "num");
  }
}

function every(ms, fn) {
  const run = () => fn().catch(err => {
    document.getElementById("status").textContent = `admin API error: ${err.message}`;
  });
  run();
  return setInterval(run, ms);
}

function init() {
  const cluster = document.getElementById("cluster");
  if (params.get("cluster")) cluster.add(new Option(params.get("cluster"), params.get("cluster"), true, true));
  const since = document.getElementById("since");
  if (params.get("since")) {
    if (![...since.options].some(o => o.value === params.get("since"))) since.add(new Option(params.get("since"), params.get("since")));
    since.value = params.get("since");
  }
  for (const el of [cluster, since]) el.addEventListener("change", () => refreshHistory());
  every(2000, refreshWeights);
  every(5000, refreshHistory);
  every(3000, refreshDecisions);
}

init();
