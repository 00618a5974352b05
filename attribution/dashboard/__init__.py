"""The read-only attribution dashboard: ClickHouse queries, Plotly figures and a FastAPI page.

- `queries`: every SQL statement the page runs (bound `%(name)s` parameters only; accepted by
  ClickHouse 18.16 and current releases), and the time `Window` they read.
- `panels`: the page's panels in order (`build`), made by `events` (raw event tables) and
  `runs` (stored attribution runs) from query rows into Plotly figure dicts (`figures`).
- `app`: the FastAPI app (`create_app`), serving the page, its JSON and Plotly's own bundled
  `plotly.min.js` (no CDN).
"""
