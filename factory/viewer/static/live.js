// Polls the run's status and shows how many groups were committed since the page was drawn (text only, no HTML).
(function () {
  var count = document.getElementById("live-count");
  if (!count) return;
  var url = count.getAttribute("data-url");
  var shown = parseInt(count.getAttribute("data-groups"), 10);
  var fresh = document.getElementById("live-new");
  function poll() {
    fetch(url, {credentials: "same-origin"}).then(function (r) { return r.json(); }).then(function (s) {
      count.textContent = String(s.groups);
      count.setAttribute("data-current", String(s.groups));
      if (fresh && s.groups > shown) {
        fresh.textContent = (s.groups - shown) + " new groups: reload to show them";
        fresh.hidden = false;
      }
    }).catch(function () {}).then(function () { setTimeout(poll, 2000); });
  }
  setTimeout(poll, 2000);
})();
