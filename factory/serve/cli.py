"""`run-api`: serve Atropos's batching API from the shard store (drop-in for atroposlib's run-api)."""

from __future__ import annotations

import logging
import os
import sys
from collections.abc import Sequence

import uvicorn

from factory.config import ConfigError, build_config, split_config_path
from factory.serve.app import create_app
from factory.serve.config import ServeConfig

logger = logging.getLogger(__name__)

TOKEN_ENV = "FACTORY_API_TOKEN"
"""Environment variable that sets api_token without putting it on the command line."""


def load_config(args: Sequence[str], values: dict | None = None) -> ServeConfig:
    """YAML (--config) < `values` < dotted CLI overrides; Atropos's `--reload` is accepted and ignored."""
    args = [arg for arg in args if arg != "--reload"]
    path, rest = split_config_path(args)
    values = dict(values or {})
    if os.environ.get(TOKEN_ENV):
        values.setdefault("api_token", os.environ[TOKEN_ENV])
    return build_config(ServeConfig, yaml_path=path, cli_args=rest, values=values)


def serve(config: ServeConfig) -> None:
    """Run the service until interrupted (SIGINT/SIGTERM stop it cleanly)."""
    logging.basicConfig(level=config.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    app = create_app(config)
    uvicorn.run(app, host=config.host, port=config.port, log_level=config.log_level.lower(), access_log=False)


def main(argv: Sequence[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] in ("-h", "--help"):
        print("usage: run-api [--config serve.yaml] [--port 8000] [--host 0.0.0.0] [--store_root ./data] "
              "[--follow_runs '[run-1]'] [--<field> value ...]\n\nfields:")
        for name, field in ServeConfig.model_fields.items():
            print(f"  --{name:28s} {field.description} (default {field.default!r})")
        return
    try:
        config = load_config(argv)
    except ConfigError as error:
        print(f"run-api: {error}", file=sys.stderr)
        raise SystemExit(2) from None
    serve(config)


if __name__ == "__main__":
    main()
