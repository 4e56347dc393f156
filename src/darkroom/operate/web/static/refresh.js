// Refreshes the element marked data-refresh-s every so many seconds, and the element marked
// data-live when a photo event arrives on /live (Server-Sent Events; data-photo: only that
// photo's), by fetching the same page and swapping that element in (no framework, no build
// step). At most one fetch a second however many events arrive; pauses while hidden.
(function () {
  "use strict";
  const live = document.querySelector("[data-refresh-s], [data-live]");
  if (!live) return;
  const minGapMs = 1000;
  // The overview's numbers are a snapshot up to this old: fetched sooner, it could predate
  // the event that asked for it.
  const settleMs = Number(live.dataset.settleMs || 0);
  let last = 0;
  let timer = null;
  async function refresh() {
    if (document.hidden) return;
    last = Date.now();
    try {
      const response = await fetch(window.location.href, { credentials: "same-origin" });
      if (!response.ok) return;
      const page = new DOMParser().parseFromString(await response.text(), "text/html");
      const fresh = page.getElementById(live.id);
      if (fresh) live.replaceChildren(...fresh.childNodes);
      live.dataset.refreshedAt = String(Date.now());
    } catch (error) {
      // The server is restarting or unreachable: keep the last numbers, try again later.
    }
  }
  function soon() {
    if (timer) return;
    timer = window.setTimeout(function () {
      timer = null;
      refresh();
    }, Math.max(settleMs, last + minGapMs - Date.now()));
  }
  if (live.dataset.refreshS) {
    window.setInterval(refresh, 1000 * Number(live.dataset.refreshS));
  }
  if (live.dataset.live !== undefined && window.EventSource) {
    const photo = live.dataset.photo;
    const source = new EventSource("/live");
    source.addEventListener("photo", function (event) {
      if (!photo || JSON.parse(event.data).photo_id === photo) soon();
    });
    source.addEventListener("resync", soon);
    source.addEventListener("open", function () {
      live.dataset.liveOpen = "true";
    });
  }
})();
