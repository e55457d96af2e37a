"""The viewer's web app (Starlette): runs, a run's filtered groups with plots, one group, a status API for live counts.

Every response carries a Content-Security-Policy that allows only this
origin's CSS and script and `data:` images, so even a template mistake could
not run a script from a completion. With a token, every request needs
`Authorization: Bearer <token>` (as the batching API), or the cookie that
opening any page once with `?token=<token>` sets (for browsers).
"""

from __future__ import annotations

import hmac
import logging
import math
import os
import re
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass
from http.cookies import SimpleCookie
from typing import Any
from urllib.parse import parse_qsl, quote, urlencode

import numpy as np
import polars as pl
import pyarrow.compute as pc
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import HTMLResponse, JSONResponse, PlainTextResponse, RedirectResponse, Response
from starlette.routing import Mount, Route
from starlette.staticfiles import StaticFiles
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from factory.store_object import open_store
from factory.viewer import plots
from factory.viewer.columns import Columns, histogram
from factory.viewer.index import Filters, RunIndex, StoreIndex
from factory.viewer.render import environment, group_view

CSP = ("default-src 'none'; style-src 'self'; script-src 'self'; img-src 'self' data:; connect-src 'self'; "
       "form-action 'self'; base-uri 'none'; frame-ancestors 'none'")
SECURITY_HEADERS = [
    (b"content-security-policy", CSP.encode()),
    (b"x-content-type-options", b"nosniff"),
    (b"referrer-policy", b"no-referrer"),
    (b"x-frame-options", b"DENY"),
    (b"cache-control", b"no-store"),
]
COOKIE = "view_run_token"
GROUP_COLUMNS = ["group_id", "run_id", "env", "item_key", "policy_version", "created_at", "scores", "tokens", "masks",
                 "messages", "images", "generation_params"]
_UUID = re.compile(r"^[0-9a-fA-F-]{8,64}$")
logger = logging.getLogger(__name__)
REWARD_KEYS = ("reward_mean", "reward/mean", "mean_reward", "train/reward_mean", "reward")
"""Keys of a trainer metrics line taken as the reward, first present wins; x is `step` (else the line number)."""


@dataclass
class ViewerConfig:
    """What `view-run` serves and how."""

    store: str = "./data"
    run: str | None = None
    host: str = "127.0.0.1"
    port: int = 8080
    token: str | None = None
    prefect_ui: str | None = None
    page_size: int = 50
    text_budget_s: float = 1.0
    """Most seconds a text search scans shards before answering with what it found so far."""
    index_budget_s: float = 0.3
    """Most seconds a request spends indexing new shards (newest first); the rest is indexed in the background."""
    background_index: bool = True
    """Index the rest of a run in a background thread (else each request indexes its budget's worth)."""


def prefect_ui_url(configured: str | None = None) -> str:
    """Base URL of the Prefect UI: the option, else PREFECT_UI_URL, else PREFECT_API_URL without /api, else local."""
    if configured:
        return configured.rstrip("/")
    if os.environ.get("PREFECT_UI_URL"):
        return os.environ["PREFECT_UI_URL"].rstrip("/")
    api = os.environ.get("PREFECT_API_URL", "").rstrip("/")
    if api:
        return api.removesuffix("/api")
    return "http://127.0.0.1:4200"


class SecurityHeaders:
    """Adds CSP and friends to every HTTP response."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return

        async def with_headers(message: Message) -> None:
            if message["type"] == "http.response.start":
                names = {key.lower() for key, _ in message.get("headers", [])}
                missing = [header for header in SECURITY_HEADERS if header[0] not in names]
                message["headers"] = list(message.get("headers", [])) + missing
            await send(message)

        await self.app(scope, receive, with_headers)


def same_origin_path(path: str) -> str:
    """`path` as a redirect target that can only stay on this origin: exactly one leading '/', then the rest
    percent-encoded (backslashes, spaces, tabs and other controls included), so `//host`, `/\\host`,
    `/<tab>/host` (browsers drop raw tabs and newlines) and `scheme:` can never read as another host."""
    return "/" + quote(path.lstrip("/"), safe="/-._~!$&'()*+,;=:@")


class TokenGuard:
    """Bearer token (header), or the cookie set by opening a page once with `?token=...`."""

    def __init__(self, app: ASGIApp, token: str | None) -> None:
        self.app = app
        self.token = token

    def _ok(self, given: str) -> bool:
        return self.token is not None and hmac.compare_digest(given.encode(), self.token.encode())

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or self.token is None:
            await self.app(scope, receive, send)
            return
        headers = {key.decode("latin-1").lower(): value.decode("latin-1") for key, value in scope["headers"]}
        query = parse_qsl(scope.get("query_string", b"").decode("latin-1"), keep_blank_values=True)
        given_query = next((value for key, value in query if key == "token"), None)
        if given_query is not None and self._ok(given_query):
            rest = urlencode([(k, v) for k, v in query if k != "token"])
            location = same_origin_path(scope.get("root_path", "") + scope["path"]) + (f"?{rest}" if rest else "")
            response = RedirectResponse(location, status_code=303)
            response.set_cookie(COOKIE, self.token, httponly=True, samesite="strict", path="/")
            await response(scope, receive, send)
            return
        authorization = headers.get("authorization", "")
        cookie = SimpleCookie()
        try:
            cookie.load(headers.get("cookie", ""))
        except Exception:  # a malformed Cookie header is just no cookie
            cookie = SimpleCookie()
        from_cookie = cookie[COOKIE].value if COOKIE in cookie else ""
        scheme, _, credentials = authorization.strip().partition(" ")
        if (scheme.lower() == "bearer" and self._ok(credentials.strip())) or self._ok(from_cookie):
            await self.app(scope, receive, send)
            return
        response = PlainTextResponse(
            "missing or wrong bearer token: send 'Authorization: Bearer <token>' (view-run's --token), "
            "or open any page once with ?token=<token> in a browser", status_code=401,
            headers={"WWW-Authenticate": "Bearer"})
        await response(scope, receive, send)


class Viewer:
    """The pages, over a `StoreIndex`."""

    def __init__(self, config: ViewerConfig) -> None:
        self.config = config
        self.store = open_store(config.store)
        self.index = StoreIndex(self.store)
        self.templates = environment()
        for name in ("index.html", "run.html", "group.html"):
            self.templates.get_template(name)  # compile now, not on the first request
        self.prefect_ui = prefect_ui_url(config.prefect_ui)
        self._cache: OrderedDict[tuple[Any, ...], Any] = OrderedDict()
        self._background: threading.Thread | None = None
        self._todo: set[str] = set()
        self._todo_lock = threading.Lock()

    def _index_in_background(self, run_ids: list[str]) -> None:
        """Finish indexing these runs in one background thread, a slice at a time so pages keep answering."""
        with self._todo_lock:
            self._todo.update(run_ids)
            if not self._todo or (self._background is not None and self._background.is_alive()):
                return

            def work() -> None:
                while True:
                    with self._todo_lock:
                        if not self._todo:
                            return
                        run_id = self._todo.pop()
                    try:
                        index = self.index.run(run_id, budget_s=0.25)
                        while index.pending:
                            time.sleep(0.005)  # let waiting requests take the index lock
                            index.refresh(budget_s=0.25)
                    except Exception:  # a run that cannot be indexed shows its problem on its own page
                        logger.exception("indexing run %s failed", run_id)

            self._background = threading.Thread(target=work, name="view-run-index", daemon=True)
            self._background.start()

    def _cached(self, key: tuple[Any, ...], make: Any) -> Any:
        if key in self._cache:
            self._cache.move_to_end(key)
            return self._cache[key]
        value = make()
        self._cache[key] = value
        while len(self._cache) > 64:
            self._cache.popitem(last=False)
        return value

    def page(self, request: Request, name: str, status: int = 200, **context: Any) -> HTMLResponse:
        html = self.templates.get_template(name).render(base=request.scope.get("root_path", ""), **context)
        return HTMLResponse(html, status_code=status)

    def not_found(self, request: Request, what: str) -> HTMLResponse:
        return HTMLResponse(f"<!doctype html><meta charset='utf-8'><title>not found</title><p>{_escape(what)}</p>",
                            status_code=404)

    def run_index(self, run_id: str) -> RunIndex | None:
        """The run's index after at most `index_budget_s` of indexing; the rest continues in the background."""
        try:
            index = self.index.run(run_id, budget_s=self.config.index_budget_s)
        except (KeyError, ValueError):
            return None
        if index.pending and self.config.background_index:
            self._index_in_background([run_id])
        return index

    # ---- routes ----
    def home(self, request: Request) -> Response:
        if self.config.run and "all" not in request.query_params:
            root = request.scope.get("root_path", "")
            return RedirectResponse(f"{root}/run/{quote(self.config.run)}", status_code=307)
        runs = []
        run_ids = self.index.run_ids()
        self._index_in_background([r for r in run_ids if self.index.indexed(r) is None])
        for run_id in run_ids:
            index = self.index.indexed(run_id)
            groups, shards = self.index.commit_counts(run_id)
            envs = None
            if index is not None and index.lock.acquire(blocking=False):
                try:  # a run being indexed right now shows "indexing…" instead of blocking the list
                    index.refresh(budget_s=0.0)
                    envs = None if index.pending else self._facets(index)["envs"]
                finally:
                    index.lock.release()
            metrics_path, _ = index.train_metrics() if index is not None else (None, [])
            if index is None:
                metrics_path = self.index.has_metrics(run_id) or None
            runs.append({"id": run_id, "groups": groups, "shards": shards, "envs": envs, "metrics": bool(metrics_path)})
        return self.page(request, "index.html", runs=runs, store=str(self.store.root))

    def status(self, request: Request) -> Response:
        index = self.run_index(request.path_params["run"])
        if index is None:
            return JSONResponse({"detail": "no such run"}, status_code=404)
        return JSONResponse({"run": index.run_id, "groups": index.columns.size, "shards": len(index.shards),
                             "pending_shards": index.pending, "problems": len(index.problems)})

    def _facets(self, index: RunIndex) -> dict[str, Any]:
        columns = index.columns

        def make() -> dict[str, Any]:
            return {"envs": columns.counts("env"), "families": columns.counts("family"),
                    "difficulties": [d for d, _ in columns.counts("difficulty")],
                    "versions": [v for v, _ in columns.counts("policy_version")]}

        return self._cached(("facets", index.run_id, id(columns)), make)

    def _plots(self, index: RunIndex, filters: Filters, mask: np.ndarray | None) -> list[Any]:
        columns = index.columns
        query = {k: v for k, v in filters.as_query().items() if k != "text"}

        def make() -> list[Any]:
            out = []
            positions = None if mask is None else np.flatnonzero(mask)
            chosen, used = columns.completions(positions)
            total = columns.size if positions is None else len(positions)
            sampled = f" ({used:,} of {total:,} groups)" if used < total else ""
            for values, title, label in ((columns.scores, "score per completion" + sampled, "score"),
                                         (columns.lengths, "length per completion" + sampled, "tokens")):
                values = values[chosen]
                if len(values):
                    counts, edges = histogram(values)
                    out.append(plots.histogram(counts, edges, title, label))
                else:
                    out.append(plots.empty_plot(title))
            out.append(reward_over_time(columns, mask))
            return out

        return self._cached(("plots", index.run_id, id(columns), tuple(sorted(query.items()))), make)

    def run_page(self, request: Request) -> Response:
        run_id = request.path_params["run"]
        index = self.run_index(run_id)
        if index is None:
            return self.not_found(request, f"no run {run_id!r} in {self.store.root}")
        error = None
        try:
            filters = Filters.from_query(request.query_params)
        except ValueError as problem:
            filters, error = Filters(), f"{problem}; showing all groups"
        try:
            offset = max(0, int(request.query_params.get("offset", "0") or 0))
        except ValueError:
            offset = 0
        limit = self.config.page_size
        with index.lock:  # one consistent snapshot while the background indexer adds shards
            columns, pending, shards = index.columns, index.pending, len(index.shards)
        mask = columns.mask(filters)
        # Newest first: positions in reverse commit order.
        newest_first = (np.arange(columns.size - 1, -1, -1) if mask is None else np.flatnonzero(mask)[::-1])
        note = ""
        if filters.text:
            page_positions, matched, exact, note = search_text(index, newest_first, filters.text, offset, limit,
                                                               self.config.text_budget_s)
        else:
            page_positions, matched, exact = newest_first[offset: offset + limit], len(newest_first), True
        rows = index.rows_at(page_positions)
        payload = index.read_rows(rows, ["messages"]) if rows.height else []
        row_dicts = []
        for row, extra in zip(rows.iter_rows(named=True), payload):
            row["preview"] = prompt_preview(extra.get("messages"))
            row_dicts.append(row)
        facets = self._facets(index)
        plot_list = list(self._plots(index, filters, mask))
        metrics_path, metrics = index.train_metrics()
        if metrics_path is not None:
            plot_list.append(trainer_curve(metrics))
        base_query = filters.as_query()
        url = f"{request.scope.get('root_path', '')}/run/{quote(run_id)}?"
        prev_url = url + urlencode({**base_query, "offset": max(0, offset - limit)}) if offset > 0 else None
        next_url = url + urlencode({**base_query, "offset": offset + limit}) if offset + limit < matched else None
        flow_runs = [{**fr, "url": f"{self.prefect_ui}/runs/flow-run/{quote(fr['id'])}" if _UUID.match(fr["id"])
                      else None} for fr in index.flow_runs()]
        return self.page(
            request, "run.html", run_id=run_id, total=columns.size, shards=shards, pending=pending,
            problems=sorted(index.problems.items()), envs=facets["envs"], families=facets["families"],
            difficulties=facets["difficulties"], versions=facets["versions"], drops=index.drops(),
            flow_runs=flow_runs, filters=filters, error=error, plots=plot_list, rows=row_dicts, matched=matched,
            matched_exact=exact, note=note, offset=offset, prev_url=prev_url, next_url=next_url,
            metrics_path=str(metrics_path) if metrics_path else None,
        )

    def group_page(self, request: Request) -> Response:
        run_id, group_id = request.path_params["run"], request.path_params["group_id"]
        index = self.run_index(run_id)
        if index is None:
            return self.not_found(request, f"no run {run_id!r} in {self.store.root}")
        hits = index.frame.filter(pl.col("group_id") == group_id)
        if hits.height == 0:
            return self.not_found(request, f"no group {group_id!r} in run {run_id!r}")
        hit = hits.tail(1)
        row = index.read_rows(hit, GROUP_COLUMNS)[0]
        info = hit.row(0, named=True)
        view = group_view(row, lengths=info["lengths"])
        return self.page(request, "group.html", run_id=run_id, g=view, shard=index.by_id[info["shard"]].record.shard,
                         row=info["row"], family=info["family"], difficulty=info["difficulty"])


def _escape(text: str) -> str:
    from html import escape

    return escape(text)


def prompt_preview(messages: Any, limit: int = 160) -> str:
    """The last user message of the first conversation, cut to `limit` characters (plain text)."""
    import json

    try:
        conversations = json.loads(messages) if isinstance(messages, str) else messages
        first = conversations[0] if conversations else []
        users = [m.get("content") for m in first if isinstance(m, dict) and m.get("role") == "user"]
        text = str(users[-1] if users else (first[0].get("content") if first else ""))
    except (ValueError, TypeError, AttributeError, IndexError):
        return ""
    return text if len(text) <= limit else text[: limit - 1] + "…"


def search_text(index: RunIndex, newest_first: np.ndarray, needle: str, offset: int, limit: int,
                budget_s: float) -> tuple[np.ndarray, int, bool, str]:
    """Positions among `newest_first` whose messages, item key or group id contain `needle` (case-insensitive).

    Shards are scanned in page order, reading only the `messages` of the
    candidate rows' row groups; the scan stops once the page (plus one row,
    to know whether there is a next page) is full or `budget_s` has passed,
    and then the count is a lower bound. Returns (page positions, matches
    found, whether that count is exact, a note).
    """
    started = time.monotonic()
    want = offset + limit + 1
    lowered = needle.lower()
    columns = index.columns
    shards = columns.shard[newest_first]
    bounds = np.concatenate([[0], np.flatnonzero(np.diff(shards)) + 1, [len(shards)]]).astype(int)
    found: list[np.ndarray] = []
    n_found = scanned_to = 0
    for start, end in zip(bounds[:-1], bounds[1:]):
        if end <= start:  # no candidates at all
            continue
        if n_found >= want or (time.monotonic() - started > budget_s and start > 0):
            break
        positions = newest_first[start:end]
        rows = columns.row[positions]
        table = index.read_table(int(shards[start]), rows.tolist(), ["messages", "item_key", "group_id"])
        hits = pc.fill_null(pc.match_substring(table.column("messages"), needle, ignore_case=True), False)
        hits = pc.or_(hits, pc.match_substring(table.column("item_key"), needle, ignore_case=True))
        hits = pc.or_(hits, pc.starts_with(table.column("group_id"), lowered))
        matches = positions[hits.to_numpy(zero_copy_only=False)]
        found.append(matches)
        n_found += len(matches)
        scanned_to = int(end)
    hits_all = np.concatenate(found) if found else np.zeros(0, dtype=np.int64)
    exact = scanned_to >= len(shards)
    if exact:
        note = ""
    elif n_found >= want:
        note = f"stopped after a full page; scanned {scanned_to} of {len(shards)} groups"
    else:
        note = f"scan stopped after {budget_s:g} s; scanned {scanned_to} of {len(shards)} groups"
    return hits_all[offset: offset + limit], n_found, exact, note


def reward_over_time(columns: Columns, mask: np.ndarray | None, buckets: int = 40) -> Any:
    """Mean group score per time bucket (minutes since the first group)."""
    seconds = columns.created_s if mask is None else columns.created_s[mask]
    scores = columns.score_mean if mask is None else columns.score_mean[mask]
    if len(seconds) == 0:
        return plots.empty_plot("reward over time")
    start, end = float(seconds.min()), float(seconds.max())
    if end - start < 1e-9:
        return plots.lines({"mean score": ([0.0], [float(np.nanmean(scores))])}, "reward over time", "minutes")
    which = np.minimum(((seconds - start) * (buckets / (end - start))).astype(np.int64), buckets - 1)
    sums = np.bincount(which, weights=np.nan_to_num(scores), minlength=buckets)
    counts = np.bincount(which, minlength=buckets)
    width = (end - start) / buckets
    xs = [(i + 0.5) * width / 60 for i in range(buckets) if counts[i]]
    ys = [sums[i] / counts[i] for i in range(buckets) if counts[i]]
    return plots.lines({"mean score": (xs, ys)}, "reward over time", "minutes")


def trainer_curve(metrics: list[dict[str, Any]]) -> Any:
    """The trainer's reward per step from its metrics lines."""
    xs, ys = [], []
    for number, row in enumerate(metrics):
        key = next((k for k in REWARD_KEYS if isinstance(row.get(k), int | float)), None)
        if key is None:
            continue
        step = row.get("step", number)
        if isinstance(step, int | float) and math.isfinite(float(row[key])):
            xs.append(float(step))
            ys.append(float(row[key]))
    return plots.lines({"trainer reward": (xs, ys)}, "trainer reward curve", "step")


def create_app(config: ViewerConfig) -> ASGIApp:
    """The ASGI app: pages, static files, security headers, and the token check when a token is set."""
    viewer = Viewer(config)
    static = StaticFiles(packages=[("factory.viewer", "static")])
    app = Starlette(routes=[
        Route("/", viewer.home),
        Route("/run/{run}", viewer.run_page),
        Route("/run/{run}/group/{group_id}", viewer.group_page),
        Route("/api/run/{run}/status", viewer.status),
        Mount("/static", app=static, name="static"),
    ])
    app.state.viewer = viewer
    wrapped = SecurityHeaders(TokenGuard(app, config.token))
    wrapped.viewer = viewer  # type: ignore[attr-defined]  # benches and tests reach the index through it
    return wrapped
