/*
 * adstream web snippet: no dependencies, served by the ad server at GET /adstream.js.
 *
 *   <div id="ads"></div>
 *   <script src="https://ads.example/adstream.js"></script>
 *   <script>
 *     AdStream.load({endpoint: "https://ads.example", apiKey: "pub-…", userId: "u-42",
 *                    slot: "feed", k: 3, container: "#ads"});
 *   </script>
 *
 * It fetches ranked ads (POST /v1/ads), renders each (default: a box with the ad id; pass
 * `render(ad, element)` for your own markup), sends a render beacon once an ad has been at least
 * `viewRatio` (0.5) visible for `viewMs` (1000 ms, the IAB display viewability rule), and a
 * click beacon on the first click. Both go to POST /v1/events with `fetch(…, {keepalive: true})`
 * (it outlives a navigation, like navigator.sendBeacon, and can carry the X-Api-Key header),
 * echoing the ad's click token: the collector refuses events without the token of an ad served
 * to this user. The render beacon is a View of the impression: a served ad becomes an
 * impression (what CPM campaigns pay for and attribution counts as a view) only when it
 * arrives; the click is a Click. Their event ids derive from the impression's, and the worker
 * takes one view per impression, so a repeated beacon counts once.
 */
(function (root) {
  "use strict";

  var MAX_ID = 64;

  function impressionId(requestId, position) {
    // schemas.ids.impression_event_id: "<request_id>/<position>" (serving's ids are 32 hex)
    var id = requestId + "/" + position;
    return id.length <= MAX_ID ? id : null;
  }

  function send(opts, event) {
    var headers = {"Content-Type": "application/json"};
    if (opts.apiKey) headers["X-Api-Key"] = opts.apiKey;
    return fetch(opts.endpoint + "/v1/events", {
      method: "POST",
      headers: headers,
      body: JSON.stringify({events: [event]}),
      keepalive: true,
      credentials: "omit",
    }).then(function (resp) {
      if (opts.onBeacon) opts.onBeacon(event, resp.status);
      return resp.status;
    }, function (err) {
      if (opts.onBeacon) opts.onBeacon(event, 0);
      return 0;
    });
  }

  function defaultRender(ad, el) {
    el.textContent = ad.ad_id;
    el.style.cursor = "pointer";
  }

  function watch(opts, el, onViewed) {
    // visible for viewMs at viewRatio or more, without interruption: then once onViewed(ms in view)
    var since = null, timer = null, done = false;
    var ratio = opts.viewRatio == null ? 0.5 : opts.viewRatio;
    var ms = opts.viewMs == null ? 1000 : opts.viewMs;
    var observer = new IntersectionObserver(function (entries) {
      entries.forEach(function (entry) {
        if (done) return;
        if (entry.isIntersecting && entry.intersectionRatio >= ratio) {
          if (timer === null) {
            since = Date.now();
            timer = setTimeout(function () {
              done = true;
              observer.disconnect();
              onViewed(Date.now() - since);
            }, ms);
          }
        } else if (timer !== null) {
          clearTimeout(timer);
          timer = null;
        }
      });
    }, {threshold: [0, ratio, 1]});
    observer.observe(el);
  }

  function place(opts, resp, container) {
    resp.ads.forEach(function (ad, position) {
      var iid = impressionId(resp.request_id, position);
      var el = document.createElement("div");
      el.className = "adstream-ad";
      el.setAttribute("data-ad-id", ad.ad_id);
      el.setAttribute("data-position", String(position));
      (opts.render || defaultRender)(ad, el);
      container.appendChild(el);
      if (iid === null || !ad.click_token) return; // no token: nothing the collector would take
      var base = {user_id: opts.userId, impression_id: iid, ad_id: ad.ad_id, click_token: ad.click_token};
      watch(opts, el, function () {
        send(opts, Object.assign({kind: "view", event_id: "v/" + iid, ts: new Date().toISOString()}, base));
      });
      var clicked = false;
      el.addEventListener("click", function () {
        if (clicked) return;
        clicked = true;
        send(opts, Object.assign({kind: "click", event_id: "c/" + iid, ts: new Date().toISOString(),
                                  campaign_id: ad.campaign_id}, base));
        if (opts.onClick) opts.onClick(ad, el);
      });
    });
  }

  function load(opts) {
    var container = typeof opts.container === "string"
      ? document.querySelector(opts.container) : opts.container;
    if (!container) return Promise.reject(new Error("adstream: container not found"));
    var headers = {"Content-Type": "application/json"};
    if (opts.apiKey) headers["X-Api-Key"] = opts.apiKey;
    var body = {user_id: opts.userId, slot: opts.slot || "feed", k: opts.k || 3};
    return fetch(opts.endpoint + "/v1/ads", {
      method: "POST", headers: headers, body: JSON.stringify(body), credentials: "omit",
    }).then(function (resp) {
      if (!resp.ok) throw new Error("adstream: /v1/ads answered " + resp.status);
      return resp.json();
    }).then(function (resp) {
      place(opts, resp, container);
      return resp;
    });
  }

  root.AdStream = {load: load, impressionId: impressionId};
})(typeof window !== "undefined" ? window : this);
