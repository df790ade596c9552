"use strict";
// crr view: renders the runs in the page's JSON block (crr/report/view.py). Plain DOM, no library, no network.
const DATA = JSON.parse(document.getElementById("crr-data").textContent);
const detail = document.getElementById("detail");

function el(tag, attrs, ...kids) {
  const e = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs || {})) {
    if (k === "class") e.className = v; else if (k === "text") e.textContent = v;
    else if (k.startsWith("on")) e.addEventListener(k.slice(2), v); else e.setAttribute(k, v);
  }
  for (const kid of kids) if (kid !== null && kid !== undefined) e.append(kid);
  return e;
}
const fmt = (x, d = 2) => (x === null || x === undefined) ? "–" : (Number.isInteger(x) ? String(x) : x.toFixed(d));
const differs = s => s.advantage !== null && s.grpo_advantage !== null && Math.abs(s.advantage - s.grpo_advantage) > 1e-9;

function advColour(a) {
  if (a === null || a === undefined) return "#d8d8d8";
  const m = Math.min(1, Math.abs(a));
  if (m < 1e-9) return "#f2f2f2";
  return a > 0 ? `rgba(30,150,60,${0.2 + 0.8 * m})` : `rgba(200,40,40,${0.2 + 0.8 * m})`;
}

function callText(s) {
  if (!s.call) return s.action;
  const args = s.call.arguments || {};
  return `${s.call.name}(${Object.entries(args).map(([k, v]) => `${k}=${JSON.stringify(v)}`).join(", ")})`;
}

// A unified diff (an edit's observation, a patch) with its lines coloured; other text as it is.
function textBlock(text, cls) {
  const pre = el("pre", {class: cls || ""});
  text = text || "";
  if (!/^(--- |\+\+\+ |diff --git|@@ )/m.test(text)) { pre.textContent = text; return pre; }
  for (const line of text.split("\n")) {
    const c = line.startsWith("@@") ? "hunk" : (line.startsWith("+") ? "add" : (line.startsWith("-") ? "del" : ""));
    pre.append(el("span", {class: c || "ctx", text: line || " "}));
  }
  return pre;
}

function stepView(s, withAdvantage) {
  const meta = s.entropy === null || s.entropy === undefined ? [] : [`H_t ${fmt(s.entropy)}`];
  if (withAdvantage) meta.unshift(`advantage ${fmt(s.advantage)}`, `GRPO ${fmt(s.grpo_advantage)}`);
  if (s.selected) meta.push("selected");
  if (s.is_error) meta.push("rejected call");
  const tool = s.call ? s.call.name : "unparsed call";
  const box = el("div", {class: "step" + (withAdvantage && differs(s) ? " differs" : ""), "data-t": s.t},
    el("div", {}, el("b", {text: `step ${s.t} · ${tool}`}), " ", el("span", {class: "meta", text: meta.join(" · ")})),
    textBlock(callText(s), "call"), textBlock(s.observation, "obs"));
  box.style.borderLeftColor = withAdvantage ? advColour(s.advantage) : "#bbb";
  return box;
}

// ---------------------------------------------------------------- training runs
function curve(name, points) {
  const pts = points.filter(p => p[1] !== null && p[1] !== undefined);
  const W = 210, H = 86, L = 34, B = 16;
  const svg = document.createElementNS("http://www.w3.org/2000/svg", "svg");
  svg.setAttribute("width", W); svg.setAttribute("height", H); svg.setAttribute("class", "curve");
  const add = (tag, attrs, text) => {
    const e = document.createElementNS(svg.namespaceURI, tag);
    for (const [k, v] of Object.entries(attrs)) e.setAttribute(k, v);
    if (text !== undefined) e.textContent = text;
    svg.append(e); return e;
  };
  add("text", {x: L, y: 10}, name + (pts.length ? ` (last ${fmt(pts[pts.length - 1][1])})` : " (none)"));
  if (!pts.length) return svg;
  const xs = pts.map(p => p[0]), ys = pts.map(p => p[1]);
  const x0 = Math.min(...xs), x1 = Math.max(...xs), y0 = Math.min(...ys), y1 = Math.max(...ys);
  const X = x => L + (x1 > x0 ? (x - x0) / (x1 - x0) : 0.5) * (W - L - 6);
  const Y = y => H - B - (y1 > y0 ? (y - y0) / (y1 - y0) : 0.5) * (H - B - 16);
  add("text", {x: 2, y: 20}, fmt(y1)); add("text", {x: 2, y: H - B}, fmt(y0));
  add("text", {x: L, y: H - 3}, `update ${x0}`); add("text", {x: W - 50, y: H - 3}, `${x1}`);
  add("polyline", {points: pts.map(p => `${X(p[0])},${Y(p[1])}`).join(" "), fill: "none", stroke: "#243447", "stroke-width": 1.5});
  for (const p of pts) add("circle", {cx: X(p[0]), cy: Y(p[1]), r: 1.8, fill: "#243447"});
  return svg;
}

function showTrajectory(run, u, traj, row) {
  document.querySelectorAll(".traj.active").forEach(e => e.classList.remove("active"));
  row.classList.add("active");
  const onlyDiff = run._filter;
  const branches = u.branches.filter(b => b.row === traj.row);
  detail.replaceChildren(
    el("h3", {text: `${traj.task_id} · sibling ${traj.sibling} · update ${u.update + 1}`}),
    el("div", {class: "meta"}, el("span", {class: "tag", text: `R = ${fmt(traj.reward)}`}),
       el("span", {class: "tag", text: `end: ${traj.end_reason}`}),
       traj.infra_error ? el("span", {class: "tag", text: `infrastructure failure: ${traj.infra_error}`}) : null,
       traj.replaced ? el("span", {class: "tag", text: "replaced by a branch (Search-Select)"}) : null,
       traj.reset ? el("span", {class: "tag", text: `restart row: steps 0-${traj.reset - 1} are a failed sibling's, masked from the loss (resets)`}) : null,
       el("span", {class: "tag", text: `${branches.length} forks`})));
  for (const s of traj.steps) {
    if (onlyDiff && !differs(s)) continue;
    detail.append(stepView(s, true));
    for (const b of branches.filter(b => b.t === s.t)) {
      const head = el("div", {class: "head",
        text: `↳ fork ${b.k_index} at step ${b.t} → return ${b.proposal === null ? "(proposal skipped)" : fmt(b.reward)}` +
              (b.infra_error ? ` (failed: ${b.infra_error})` : "") +
              (b.played_by != null ? ` (a sibling, row ${b.played_by}, played this action here: its steps and return, not forked)` : "")});
      const fork = el("div", {class: "fork", "data-t": b.t}, head,
        el("div", {class: "branch-steps"},
           el("div", {class: "meta", text: `proposal (log q ${fmt(b.proposal_logprob)}, selector score ${fmt(b.selector_score)}), then ${Math.max(0, b.steps.length - 1)} more steps, end: ${b.end_reason}`}),
           ...(b.steps.length ? b.steps.map(x => stepView(x, false)) : [textBlock(b.proposal || "", "call")])));
      head.addEventListener("click", () => fork.classList.toggle("open"));
      detail.append(fork);
    }
  }
  if (traj.model_patch) detail.append(el("h3", {text: "patch"}), textBlock(traj.model_patch, "patch"));
}

function renderTrain(run, i, list) {
  const sec = el("div", {class: "run train", id: `run-${i}`});
  const s = run.settings;
  sec.append(el("h2", {text: `training run ${run.label}`}),
    el("div", {}, ...Object.entries(s).map(([k, v]) => el("span", {class: "tag", text: `${k} ${v}`}))),
    el("h3", {text: "learning curves"}),
    el("div", {class: "curves"}, ...Object.entries(run.curves).map(([k, v]) => curve(k, v))));
  const updates = el("div", {class: "updates"});
  const box = el("input", {type: "checkbox", class: "differs-filter"});
  box.addEventListener("change", () => { run._filter = box.checked; fill(); });
  sec.append(el("h3", {text: `updates (${run.updates.length} with trajectory records)`}),
    el("label", {class: "filter"}, box, " only steps where the advantage differs from GRPO's"), updates);
  if (!run.updates.length) updates.append(el("p", {class: "hint", text: "No trajectory records (trajectories/): the run kept none (keep_trajectories: false, or made before they existed)."}));
  function fill() {
    updates.replaceChildren();
    run.updates.forEach((u, n) => {
      const rewards = u.trajectories.map(t => t.reward).filter(r => r !== null);
      const mean = rewards.length ? rewards.reduce((a, b) => a + b, 0) / rewards.length : null;
      const det = el("details", {class: "update"}, el("summary", {text: `update ${u.update + 1}: mean R ${fmt(mean)}, ${u.trajectories.length} trajectories, ${u.branches.length} forks`}));
      if (n < 3 || run._filter) det.open = true;
      const groups = {};
      for (const t of u.trajectories) (groups[t.task_id] = groups[t.task_id] || []).push(t);
      let shown = 0;
      for (const [task, trajs] of Object.entries(groups)) {
        const g = el("div", {class: "group"}, el("div", {class: "task", text: task}));
        for (const t of trajs) {
          if (run._filter && !t.steps.some(differs)) continue;
          const forked = new Set(u.branches.filter(b => b.row === t.row).map(b => b.t));
          const row = el("div", {class: "traj" + (forked.size ? " has-fork" : ""), "data-row": t.row},
            el("span", {class: "r", text: `#${t.sibling} R ${t.reward === null ? "infra" : fmt(t.reward)}`}),
            ...t.steps.map(s => {
              const b = el("span", {class: "box" + (s.selected ? " sel" : "") + (forked.has(s.t) ? " fork" : "") + (differs(s) ? " differs" : ""),
                                    title: `step ${s.t}: ${s.call ? s.call.name : "unparsed"}, advantage ${fmt(s.advantage)} (GRPO ${fmt(s.grpo_advantage)})`});
              b.style.background = advColour(s.advantage);
              return b;
            }));
          row.addEventListener("click", () => showTrajectory(run, u, t, row));
          g.append(row); shown++;
        }
        if (g.children.length > 1) det.append(g);
      }
      if (shown) updates.append(det);
    });
  }
  fill();
  list.append(sec);
}

// ---------------------------------------------------------------- evaluations
function showEval(run, id, cell) {
  document.querySelectorAll("td.cell.active").forEach(e => e.classList.remove("active"));
  cell.classList.add("active");
  detail.replaceChildren(el("h3", {text: `${id} · ${run.label}`}));
  for (const r of run.results.filter(r => r.instance_id === id)) {
    detail.append(el("div", {class: "meta"}, el("b", {text: `sample ${r.sample}: `}),
      el("span", {class: "tag", text: `R = ${fmt(r.reward)}`}), el("span", {class: "tag", text: r.resolution || "–"}),
      el("span", {class: "tag error-mode", text: `error mode: ${r.error_mode || (r.reward ? "none (solved)" : "–")}`}),
      el("span", {class: "tag", text: `end: ${r.end_reason}`}),
      r.infra_error ? el("span", {class: "tag", text: `infrastructure failure: ${r.infra_error}`}) : null),
      el("h3", {text: "patch"}), textBlock(r.model_patch || "(empty patch)", "patch"),
      el("h3", {text: `transcript (${r.steps.length} steps)`}), ...r.steps.map(s => {
        let call = null; try { call = JSON.parse(s.action); } catch (e) { /* a malformed call: shown as text */ }
        return stepView({...s, call: call && call.name ? call : null, entropy: null}, false);
      }));
  }
}

function renderEvals(runs, list) {
  const sec = el("div", {class: "run evals", id: "evals"});
  const ids = [...new Set(runs.flatMap(r => r.results.map(x => x.instance_id)))].sort();
  const solved = runs.map(r => { const m = {}; for (const x of r.results) { const c = m[x.instance_id] = m[x.instance_id] || [0, 0]; c[0] += x.reward ? 1 : 0; c[1] += 1; } return m; });
  const box = el("input", {type: "checkbox", class: "disagree-filter"});
  const table = el("table", {class: "tasks"});
  const pct = x => x === null ? "–" : (100 * x).toFixed(1);
  const head = el("tr", {}, el("th", {text: "task"}), ...runs.map(r => el("th", {title: r.path},
    el("div", {text: r.label}), el("div", {class: "meta", text: `${pct(r.scored ? r.passes / r.scored : null)} %${r.interval ? ` [${pct(r.interval[0])}, ${pct(r.interval[1])}]` : ""} of ${r.scored}`}))));
  function fill() {
    table.replaceChildren(head);
    let n = 0;
    for (const id of ids) {
      const cells = solved.map(m => m[id]);
      const any = cells.some(c => c && c[0] > 0), none = cells.some(c => c && c[0] === 0);
      if (box.checked && !(any && none)) continue;
      n++;
      table.append(el("tr", {}, el("td", {text: id}), ...cells.map((c, j) => {
        if (!c) return el("td", {text: "–"});
        const td = el("td", {class: "cell " + (c[0] === c[1] ? "pass" : (c[0] ? "part" : "fail")), "data-run": j, "data-task": id, text: `${c[0]}/${c[1]}`});
        td.addEventListener("click", () => showEval(runs[j], id, td));
        return td;
      })));
    }
    count.textContent = `${n} of ${ids.length} tasks shown`;
  }
  const count = el("span", {class: "meta"});
  box.addEventListener("change", fill);
  sec.append(el("h2", {text: `evaluations (${runs.length} runs, ${ids.length} tasks): passes / samples`}),
    el("label", {class: "filter"}, box, " only tasks one run solves and another does not · "), count, table);
  fill();
  list.append(sec);
}

function main() {
  const list = document.getElementById("list"), nav = document.getElementById("nav");
  DATA.runs.forEach((r, i) => { if (r.kind === "train") { renderTrain(r, i, list); nav.append(el("a", {href: `#run-${i}`, text: r.label})); } });
  const evals = DATA.runs.filter(r => r.kind === "eval");
  if (evals.length) { renderEvals(evals, list); nav.append(el("a", {href: "#evals", text: `evaluations (${evals.length})`})); }
  window.crrRendered = performance.now();
}
main();
