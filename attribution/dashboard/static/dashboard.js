// The dashboard page: fetch the panels for the window in the address bar and draw them.
// Plotly (served from the installed plotly package) is loaded only when a panel has data.
"use strict";

function loadPlotly() {
  return new Promise((resolve, reject) => {
    if (window.Plotly) { resolve(); return; }
    const script = document.createElement("script");
    script.src = "static/plotly.min.js";
    script.onload = () => resolve();
    script.onerror = () => reject(new Error("cannot load static/plotly.min.js"));
    document.head.appendChild(script);
  });
}

function note(target, text, kind) {
  const p = document.createElement("p");
  p.className = "note " + kind;
  p.textContent = text;
  target.appendChild(p);
}

function fillForm(win) {
  const form = document.getElementById("window");
  const asked = new URLSearchParams(window.location.search);
  for (const [name, value] of Object.entries(win)) {
    const input = form.elements.namedItem(name);
    if (!input) continue;
    if (input.tagName === "SELECT") { input.value = String(value); continue; }
    const none = name === "run" ? "latest" : "all";
    if (!asked.get(name)) input.placeholder = String(value === "" ? none : value);
    if (asked.get(name)) input.value = asked.get(name);
  }
  // the advertiser view's filters only show in that view
  for (const el of document.querySelectorAll(".advertiser-only")) el.hidden = win.view !== "advertiser";
}

// The advertisers and campaigns the filters can choose from (the rollups'), as input suggestions.
async function fillChoices(win) {
  if (win.view !== "advertiser") return;
  let body;
  try {
    const response = await fetch("api/filters");
    if (!response.ok) return;
    body = await response.json();
  } catch (err) {
    return;  // suggestions only: the view works without them
  }
  const chosen = (win.advertiser || "").split(",").filter((a) => a);
  const options = (id, values) => {
    const list = document.getElementById(id);
    for (const v of values) {
      const option = document.createElement("option");
      option.value = v;
      list.appendChild(option);
    }
  };
  options("advertisers", Object.keys(body.advertisers));
  options("campaigns", Object.entries(body.advertisers)
    .filter(([a]) => chosen.length === 0 || chosen.includes(a)).flatMap(([, cs]) => cs));
}

async function load() {
  const status = document.getElementById("status");
  const main = document.getElementById("panels");
  let body;
  let response;
  try {
    response = await fetch("api/panels" + window.location.search);
    body = await response.json();
  } catch (err) {
    status.className = "error";
    status.textContent = "cannot reach the dashboard server: " + err;
    document.body.dataset.ready = "error";
    return;
  }
  if (!response.ok) {
    status.className = "error";
    // our own errors name the value; FastAPI's 422s list each bad query parameter
    const detail = Array.isArray(body.detail)
      ? body.detail.map((d) => `${(d.loc || []).slice(-1)[0]}=${JSON.stringify(d.input)}: ${d.msg}`).join("; ")
      : null;
    status.textContent = body.error || detail || ("HTTP " + response.status);
    document.body.dataset.ready = "error";
    return;
  }
  fillForm(body.window);
  await fillChoices(body.window);
  if (body.panels.some((p) => p.figure)) {
    try {
      await loadPlotly();
    } catch (err) {
      status.className = "error";
      status.textContent = String(err);
      document.body.dataset.ready = "error";
      return;
    }
  }
  const w = body.window;
  status.className = body.no_data ? "no-data" : "";
  status.textContent = body.no_data
    ? body.message
    : `database ${body.database} · ${w.since} – ${w.until} UTC · ${w.bucket} s buckets`;
  for (const panel of body.panels) {
    const section = document.createElement("section");
    section.className = "panel";
    section.id = "panel-" + panel.id;
    section.dataset.state = panel.figure ? "data" : (panel.error ? "error" : "empty");
    const title = document.createElement("h2");
    title.textContent = panel.title;
    section.appendChild(title);
    main.appendChild(section);
    if (panel.figure) {
      const div = document.createElement("div");
      div.className = "plot";
      div.id = "plot-" + panel.id;
      section.appendChild(div);
      await Plotly.newPlot(div, panel.figure.data, panel.figure.layout,
                           {responsive: true, displaylogo: false});
    } else if (panel.error) {
      note(section, "error: " + panel.error, "error");
    } else {
      note(section, "no data: " + panel.empty, "empty");
    }
  }
  document.body.dataset.ready = "1";
}

window.addEventListener("DOMContentLoaded", load);
