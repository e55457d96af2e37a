"""`view-run`: serve the viewer over a shard store (localhost by default; a token is required to bind elsewhere).

    view-run --store ./data                       # http://127.0.0.1:8080
    view-run --store ./data --run run-1 --port 9000
    FACTORY_API_TOKEN=secret view-run --host 0.0.0.0   # the batching API's token variable; or --token
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from collections.abc import Sequence

import uvicorn

from factory.cli_errors import check_port_free, run_cli
from factory.viewer.app import ViewerConfig, create_app

TOKEN_ENV = "FACTORY_API_TOKEN"
LOCAL_HOSTS = ("127.0.0.1", "localhost", "::1")


def parse_args(argv: Sequence[str] | None = None) -> ViewerConfig:
    parser = argparse.ArgumentParser(prog="view-run", description=__doc__.splitlines()[0])
    parser.add_argument("--store", default="./data", help="Shard store root, a directory or s3://bucket/prefix (default ./data).")
    parser.add_argument("--run", default=None, help="Open this run first (the runs list stays at /?all).")
    parser.add_argument("--host", default="127.0.0.1", help="Interface to bind (default 127.0.0.1: this machine only).")
    parser.add_argument("--port", type=int, default=8080, help="TCP port (default 8080; 0 picks a free one).")
    parser.add_argument("--token", default=None,
                        help=f"Require 'Authorization: Bearer TOKEN' (or ?token=TOKEN once in a browser); "
                             f"default ${TOKEN_ENV}.")
    parser.add_argument("--insecure-no-token", action="store_true",
                        help="Allow a non-local host without a token (anyone who can reach it reads the store).")
    parser.add_argument("--prefect-ui", default=None,
                        help="Prefect UI base URL for flow-run links "
                             "(default $PREFECT_UI_URL, else $PREFECT_API_URL without /api).")
    parser.add_argument("--page-size", type=int, default=50, help="Groups per page.")
    parser.add_argument("--text-budget-s", type=float, default=1.0,
                        help="Seconds a text search may scan before answering.")
    args = parser.parse_args(argv)
    token = args.token or os.environ.get(TOKEN_ENV) or None
    if args.host not in LOCAL_HOSTS and token is None and not args.insecure_no_token:
        parser.error(f"--host {args.host} exposes the store beyond this machine: set --token (or ${TOKEN_ENV}), "
                     "or pass --insecure-no-token")
    return ViewerConfig(store=args.store, run=args.run, host=args.host, port=args.port, token=token,
                        prefect_ui=args.prefect_ui, page_size=args.page_size, text_budget_s=args.text_budget_s)


def main(argv: Sequence[str] | None = None) -> int:
    return run_cli("view-run", _main, argv)


def _main(argv: list[str]) -> int:
    config = parse_args(argv)
    check_port_free(config.host, config.port)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    from factory.store_object import is_store_url, open_store

    open_store(config.store).check()  # a missing bucket or credentials: one line now, not on the first page
    shown = f"[{config.host}]" if ":" in config.host else config.host
    where = config.store if is_store_url(config.store) else os.path.abspath(config.store)
    print(f"view-run: serving {where} on http://{shown}:{config.port}/", flush=True)
    uvicorn.run(create_app(config), host=config.host, port=config.port, log_level="warning", access_log=False)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
