"""The read-only attribution dashboard: ClickHouse queries, Plotly figures and a FastAPI page.

- `queries`: every SQL statement the page runs (bound `%(name)s` parameters only; accepted by
  ClickHouse 18.16 and current releases), and the time `Window` they read.
- `panels`: query rows → Plotly figure dicts (pure functions, no I/O).
- `app`: the FastAPI app (`create_app`), serving the page, its JSON and Plotly's own bundled
  `plotly.min.js` (no CDN).
"""
