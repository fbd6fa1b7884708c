// The pypto-serving dashboard: the history (/dashboard/history) and then a snapshot of /metrics/json
// every POLL_MS, each turned into the series of history.py's snapshot(); every chart point is derived
// from two consecutive snapshots (rates and percentiles over the interval between them), so the
// history's thinned snapshots and the live ones chart the same way.
"use strict";
(() => {
  const PREFIX = "pypto_serving_";
  const POLL_MS = 2000;
  const SHOWN_POINTS = 30; // chart points written into #dashboard-data per chart
  // Keep in step with history.DASHBOARD_FAMILIES.
  const FAMILIES = new Set([
    "generation_tokens", "prompt_tokens", "num_requests_running", "num_requests_waiting",
    "kv_cache_usage_perc", "kv_cache_group_usage_perc", "prefix_cache_queries", "prefix_cache_hits",
    "spec_decode_num_draft_tokens", "spec_decode_num_accepted_tokens", "spec_decode_num_drafts",
    "spec_decode_num_accepted_tokens_per_pos", "spec_decode_config", "time_to_first_token_seconds",
    "time_per_output_token_seconds", "inter_token_latency_seconds", "worker_restarts", "num_preemptions",
    "request_success",
  ]);
  let retention = 6 * 3600;
  let snaps = []; // [{t, values}], oldest first
  let historyCount = 0;
  const charts = {};

  function seriesKey(name, labels) {
    const shown = Object.keys(labels).filter((k) => k !== "model_name").sort();
    if (!shown.length) return name;
    return name + "{" + shown.map((k) => `${k}="${labels[k]}"`).join(",") + "}";
  }

  function snapshotOf(body) {
    const values = {};
    for (const family of body.families) {
      if (!family.name.startsWith(PREFIX) || !FAMILIES.has(family.name.slice(PREFIX.length))) continue;
      for (const s of family.samples) {
        if (s.value !== null && !s.name.endsWith("_created")) values[seriesKey(s.name, s.labels)] = s.value;
      }
    }
    return { t: body.time, values };
  }

  function headers() {
    const m = document.cookie.match(/(?:^|;\s*)pypto_serving_key=([^;]*)/);
    return m ? { Authorization: "Bearer " + decodeURIComponent(m[1]) } : {};
  }

  const v = (s, key) => s.values[PREFIX + key] ?? 0;
  const rate = (a, b, key) => (v(b, key) - v(a, key)) / (b.t - a.t);
  const ratio = (a, b, num, den) => {
    const d = v(b, den) - v(a, den);
    return d > 0 ? (v(b, num) - v(a, num)) / d : null;
  };

  // Labelled series of one name in a snapshot: {label value: key}.
  function labelled(s, name, label) {
    const out = {};
    const re = new RegExp("^" + PREFIX + name + "\\{(?:.*,)?" + label + '="([^"]*)"');
    for (const key of Object.keys(s.values)) {
      const m = key.match(re);
      if (m) out[m[1]] = key.slice(PREFIX.length);
    }
    return out;
  }

  // The q-quantile of a histogram's observations between snapshots a and b (linear within a bucket,
  // as Prometheus' histogram_quantile), or null when nothing was observed.
  function quantile(a, b, hist, q) {
    const buckets = Object.entries(labelled(b, hist + "_bucket", "le"))
      .map(([le, key]) => [le === "+Inf" ? Infinity : Number(le), v(b, key) - v(a, key)])
      .sort((x, y) => x[0] - y[0]);
    const total = buckets.length ? buckets[buckets.length - 1][1] : 0;
    if (total <= 0) return null;
    const rank = q * total;
    let prevLe = 0, prevCount = 0;
    for (const [le, count] of buckets) {
      if (count >= rank) {
        if (le === Infinity) return prevLe;
        return prevLe + (le - prevLe) * (count > prevCount ? (rank - prevCount) / (count - prevCount) : 0);
      }
      prevLe = le; prevCount = count;
    }
    return prevLe;
  }

  // The charts: each series is [label, function of two consecutive snapshots].
  function chartSpecs(last) {
    const groups = labelled(last, "kv_cache_group_usage_perc", "group");
    const positions = labelled(last, "spec_decode_num_accepted_tokens_per_pos_total", "position");
    const method = Object.keys(labelled(last, "spec_decode_config", "method"))[0];
    const pct = (hist) => [0.5, 0.9, 0.99].map((q) => [`p${q * 100}`, (a, b) => quantile(a, b, hist, q)]);
    return [
      ["tokens", "Tokens / s", [
        ["output", (a, b) => rate(a, b, "generation_tokens_total")],
        ["prompt", (a, b) => rate(a, b, "prompt_tokens_total")]]],
      ["requests", "Requests", [
        ["running", (a, b) => v(b, "num_requests_running")],
        ["waiting", (a, b) => v(b, "num_requests_waiting")]]],
      ["kv", "KV cache usage", [
        ["all groups", (a, b) => v(b, "kv_cache_usage_perc")],
        ...Object.entries(groups).map(([g, key]) => [g, (a, b) => v(b, key)])]],
      ["prefix", "Prefix-cache hit rate", [
        ["hits / queried tokens", (a, b) => ratio(a, b, "prefix_cache_hits_total", "prefix_cache_queries_total")]]],
      ["spec", "Speculative acceptance" + (method ? ` (${method})` : ""), [
        ["accepted / drafted", (a, b) => ratio(a, b, "spec_decode_num_accepted_tokens_total",
          "spec_decode_num_draft_tokens_total")],
        ...Object.entries(positions).map(([p, key]) =>
          [`position ${p}`, (a, b) => ratio(a, b, key, "spec_decode_num_drafts_total")])]],
      ["ttft", "Time to first token (s)", pct("time_to_first_token_seconds")],
      ["tpot", "Time per output token (s)", pct("time_per_output_token_seconds")],
      ["itl", "Inter-token latency (s)", pct("inter_token_latency_seconds")],
      ["restarts", "Worker restarts and preemptions (total)", [
        ["worker restarts", (a, b) => v(b, "worker_restarts_total")],
        ["preemptions", (a, b) => v(b, "num_preemptions_total")]]],
    ];
  }

  const COLORS = ["#1f77b4", "#d62728", "#2ca02c", "#ff7f0e", "#9467bd", "#8c564b", "#e377c2"];

  function render() {
    if (snaps.length < 2) return;
    const last = snaps[snaps.length - 1];
    const exported = {};
    for (const [id, title, series] of chartSpecs(last)) {
      const x = [], ys = series.map(() => []);
      for (let i = 1; i < snaps.length; i++) {
        const a = snaps[i - 1], b = snaps[i];
        if (b.t <= a.t) continue;
        x.push(b.t);
        series.forEach(([, f], j) => ys[j].push(f(a, b)));
      }
      const labels = series.map(([label]) => label);
      draw(id, title, labels, [x, ...ys]);
      exported[id] = { title, labels, x: x.slice(-SHOWN_POINTS), y: ys.map((y) => y.slice(-SHOWN_POINTS)) };
    }
    document.getElementById("dashboard-data").textContent = JSON.stringify({
      latest: last, history_snapshots: historyCount, snapshots: snaps.length, charts: exported,
    });
  }

  function draw(id, title, labels, data) {
    const key = [title, ...labels].join("|");
    let c = charts[id];
    if (c && c.key !== key) { c.plot.destroy(); c.box.remove(); c = undefined; }
    if (!c) {
      const box = document.createElement("div");
      box.className = "chart";
      box.innerHTML = `<h2>${title}<span class="now"></span></h2>`;
      document.getElementById("grid").appendChild(box);
      const opts = {
        width: 440, height: 200, legend: { live: false },
        series: [{}, ...labels.map((label, i) => ({ label, stroke: COLORS[i % COLORS.length], spanGaps: false }))],
        axes: [{}, { size: 60 }],
      };
      c = charts[id] = { key, box, plot: new uPlot(opts, data, box) };
    } else {
      c.plot.setData(data);
    }
    const now = data.slice(1).map((y) => y[y.length - 1]);
    c.box.querySelector(".now").textContent = now.map((y) => (y === null ? "–" : Number(y.toPrecision(3)))).join(" / ");
  }

  function keep(s) {
    if (snaps.length && s.t <= snaps[snaps.length - 1].t) return;
    snaps.push(s);
    const oldest = s.t - retention;
    while (snaps.length && snaps[0].t < oldest) snaps.shift();
  }

  function status(text, error) {
    const el = document.getElementById("status");
    el.textContent = text;
    el.className = error ? "error" : "";
  }

  async function loadHistory() {
    const r = await fetch("/dashboard/history", { headers: headers() });
    if (!r.ok) throw new Error(`/dashboard/history: HTTP ${r.status}`);
    const body = await r.json();
    retention = body.retention;
    for (const s of body.snapshots) keep({ t: s.t, values: s.values });
    historyCount = body.snapshots.length;
  }

  async function poll() {
    try {
      const r = await fetch("/metrics/json", { headers: headers() });
      if (!r.ok) throw new Error(`/metrics/json: HTTP ${r.status}`);
      keep(snapshotOf(await r.json()));
      render();
      status(`updated ${new Date().toLocaleTimeString()} · ${snaps.length} samples`, false);
    } catch (e) {
      status(String(e), true);
    }
  }

  (async () => {
    try { await loadHistory(); } catch (e) { status(String(e), true); }
    await poll();
    setInterval(poll, POLL_MS);
  })();
})();
