"""`python -m environments`: list the environments, run one by name, or write a new one.

    python -m environments list                       built-ins and installed plugins (with load errors)
    python -m environments run NAME process --config FILE --env.group_size 8
    python -m environments run NAME {evaluate,serve} ...
    python -m environments new NAME [--path DIR] [--prefect-yaml FILE | --no-deployment]
"""

from __future__ import annotations

import argparse
import sys


def _list() -> int:
    from environments.registry import discover

    entries = discover(check=True)
    width = max(len(e.name) for e in entries)
    for entry in entries:
        status = "ok" if entry.error is None else f"error: {entry.error}"
        print(f"{entry.name:<{width}}  {entry.source:<28}  {entry.ref}  [{status}]")
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["run"]:  # everything after the name goes to the env script's command line untouched
        if len(argv) < 2:
            print("usage: python -m environments run NAME {process,evaluate,serve} [--config FILE] ...",
                  file=sys.stderr)
            return 2
        from environments.registry import resolve
        from flows.datagen import cli

        try:
            ref = resolve(argv[1])
        except ValueError as error:
            print(f"error: {error}", file=sys.stderr)
            return 2
        return cli(ref, argv[2:])
    parser = argparse.ArgumentParser(prog="python -m environments", description=__doc__.splitlines()[0])
    commands = parser.add_subparsers(dest="command", required=True)
    commands.add_parser("list", help="every environment by name, where it comes from, and whether it loads")
    commands.add_parser("run", help="run an environment by name: run NAME {process,evaluate,serve} ...")
    new = commands.add_parser("new", help="write a new environment as a plugin package")
    new.add_argument("name", help="environment name (lower case, digits, _)")
    new.add_argument("--path", help="package directory to write (default: plugins/NAME)")
    new.add_argument("--prefect-yaml", default="prefect.yaml", help="add a NAME-datagen deployment here")
    new.add_argument("--no-deployment", action="store_true", help="do not touch prefect.yaml")
    args = parser.parse_args(argv)
    if args.command == "list":
        return _list()
    from environments.scaffold import ScaffoldError, new_env

    try:
        written = new_env(args.name, args.path, None if args.no_deployment else args.prefect_yaml)
    except ScaffoldError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    for path in written:
        print(f"wrote {path}")
    root = written[0].parent
    print(f"next: pip install -e {root} && python -m environments list && pytest {root / 'tests'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
