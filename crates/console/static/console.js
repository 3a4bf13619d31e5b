// leasehold console: live parts of the pages, over Server-Sent Events.
// No build step, no dependencies. Each element with data-live follows
// that URL; the server sends HTML fragments it rendered itself.
"use strict";

function rowsFrom(html) {
  const t = document.createElement("tbody");
  t.innerHTML = html;
  return Array.from(t.children);
}

function followJobs(tbody) {
  const active = document.getElementById("active");
  const finished = document.getElementById("finished");
  const terminal = ["completed", "failed", "cancelled", "dead", "rejected"];
  const es = new EventSource(tbody.dataset.live);
  es.addEventListener("row", (m) => {
    const d = JSON.parse(m.data);
    const [row] = rowsFrom(d.html);
    const old = document.querySelector('tr[data-id="' + CSS.escape(d.id) + '"]');
    const isTerminal = terminal.includes(d.status);
    if (old) {
      old.replaceWith(row);
      return;
    }
    const target = isTerminal ? finished : active;
    if (!target || (target === active && target.dataset.first !== "true")) return;
    const want = target === active ? active.dataset.status : "";
    if (want && want !== d.status) return;
    target.prepend(row);
  });
}

function followJob(tbody) {
  const es = new EventSource(tbody.dataset.live);
  es.addEventListener("ev", (m) => {
    const d = JSON.parse(m.data);
    if (tbody.querySelector('tr[data-seq="' + d.seq + '"]')) return;
    // A reconnect starts again from the page's first sequence: rows
    // already shown are skipped above.
    for (const r of rowsFrom(d.html)) tbody.append(r);
  });
  es.addEventListener("record", (m) => {
    const d = JSON.parse(m.data);
    const s = document.getElementById("summary");
    if (s) s.innerHTML = d.html;
  });
}

function followFleet(div) {
  const es = new EventSource(div.dataset.live);
  es.addEventListener("fleet", (m) => {
    div.innerHTML = JSON.parse(m.data).html;
  });
}

document.addEventListener("DOMContentLoaded", () => {
  const jobs = document.querySelector("tbody#active[data-live], tbody#finished[data-live]");
  if (jobs) followJobs(jobs);
  const tl = document.querySelector("tbody#timeline[data-live]");
  if (tl) followJob(tl);
  const fleet = document.querySelector("#fleet[data-live]");
  if (fleet) followFleet(fleet);
});
