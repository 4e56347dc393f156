// Refreshes the element marked data-refresh-s every so many seconds by fetching the same
// page and swapping that element in (no framework, no build step). Pauses while hidden.
(function () {
  "use strict";
  const live = document.querySelector("[data-refresh-s]");
  if (!live) return;
  const periodMs = 1000 * Number(live.dataset.refreshS || 5);
  async function refresh() {
    if (document.hidden) return;
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
  window.setInterval(refresh, periodMs);
})();
