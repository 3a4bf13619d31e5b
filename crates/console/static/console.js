// leasehold console: live parts of the pages, over Server-Sent Events.
// No build step, no dependencies. Each element with data-live follows
// that URL; the server sends HTML fragments it rendered itself.
//
// A live connection is given back whenever the page is hidden (another
// tab, a navigation away, the back-forward cache) and taken again when it
// is shown: a browser keeps 6 HTTP/1.1 connections per host, so pages
// kept open or cached with their streams would use them all up and the
// console would stop loading.
"use strict";

function rowsFrom(html) {
  const t = document.createElement("tbody");
  t.innerHTML = html;
  return Array.from(t.children);
}

// Follows `url()` with `handlers` (event name to function) while the page
// is shown. `resumed()`, if given, is called each time the stream is taken
// again after the page was hidden, to catch up on what it missed: once the
// stream is open (the server follows from then on), so a change between
// the catch-up read and the stream is in one or the other.
function live(url, handlers, resumed) {
  let es = null;
  let hidden = false;
  const open = () => {
    if (es) return;
    es = new EventSource(url());
    for (const [name, f] of Object.entries(handlers)) es.addEventListener(name, f);
    if (hidden && resumed) es.addEventListener("open", resumed, { once: true });
    hidden = false;
  };
  const close = () => {
    if (!es) return;
    es.close();
    es = null;
    hidden = true;
  };
  window.addEventListener("pagehide", close);
  window.addEventListener("pageshow", open);
  document.addEventListener("visibilitychange", () => {
    if (document.visibilityState === "hidden") close();
    else open();
  });
  open();
}

function followJobs(tbody) {
  const active = document.getElementById("active");
  const finished = document.getElementById("finished");
  const terminal = ["completed", "failed", "cancelled", "dead", "rejected"];
  // While a resumed page reads what it missed, rows are held, then
  // applied on top of it (each row is a job's latest state).
  let held = null;
  const apply = (d) => {
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
  };
  const caughtUp = () => {
    const rows = held || [];
    held = null;
    rows.forEach(apply);
  };
  const resumed = () => {
    held = [];
    fetch(location.href, { credentials: "same-origin" })
      .then((r) => (r.ok ? r.text() : Promise.reject(r.status)))
      .then((text) => {
        const doc = new DOMParser().parseFromString(text, "text/html");
        for (const id of ["active", "finished", "active-count"]) {
          const mine = document.getElementById(id);
          const theirs = doc.getElementById(id);
          if (mine && theirs) mine.innerHTML = theirs.innerHTML;
        }
      })
      .catch(() => {})
      .finally(caughtUp);
  };
  live(() => tbody.dataset.live, {
    row: (m) => {
      const d = JSON.parse(m.data);
      if (held) held.push(d);
      else apply(d);
    },
  }, resumed);
}

// The job's waterfall, fetched again (at most once a second) as events land.
function waterfallRefresher() {
  let timer = null;
  return () => {
    const wf = document.getElementById("waterfall");
    if (!wf || timer) return;
    timer = setTimeout(() => {
      timer = null;
      fetch(wf.dataset.src, { credentials: "same-origin" })
        .then((r) => (r.ok ? r.text() : Promise.reject(r.status)))
        .then((html) => { wf.outerHTML = html; })
        .catch(() => {});
    }, 1000);
  };
}

function followJob(tbody) {
  const refresh = waterfallRefresher();
  // Taken again, the stream starts after the last row shown.
  const url = () => {
    const u = new URL(tbody.dataset.live, location.href);
    const seqs = Array.from(tbody.querySelectorAll("tr[data-seq]"), (r) => +r.dataset.seq);
    if (seqs.length) u.searchParams.set("after", String(Math.max(...seqs)));
    return u.pathname + u.search;
  };
  live(url, {
    ev: (m) => {
      const d = JSON.parse(m.data);
      if (tbody.querySelector('tr[data-seq="' + d.seq + '"]')) return;
      // A reconnect starts again from the page's first sequence: rows
      // already shown are skipped above.
      for (const r of rowsFrom(d.html)) tbody.append(r);
      refresh();
    },
    record: (m) => {
      const d = JSON.parse(m.data);
      const s = document.getElementById("summary");
      if (s) s.innerHTML = d.html;
    },
  });
}

function followFleet(div) {
  live(() => div.dataset.live, {
    fleet: (m) => {
      div.innerHTML = JSON.parse(m.data).html;
    },
  });
}

document.addEventListener("DOMContentLoaded", () => {
  const jobs = document.querySelector("tbody#active[data-live], tbody#finished[data-live]");
  if (jobs) followJobs(jobs);
  const tl = document.querySelector("tbody#timeline[data-live]");
  if (tl) followJob(tl);
  const fleet = document.querySelector("#fleet[data-live]");
  if (fleet) followFleet(fleet);
  // A running bulk action's page reloads itself while it is shown.
  const again = document.querySelector("[data-refresh]");
  if (again) {
    setTimeout(function reload() {
      if (document.visibilityState === "visible") location.reload();
      else setTimeout(reload, 1000);
    }, +again.dataset.refresh * 1000);
  }
});
