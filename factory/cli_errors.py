"""One way every command ends on a user error: a last line naming the cause and the fix, no traceback.

Console scripts and `python -m` mains run through `run_cli(prog, main, argv)`:

- a user error (bad config key, missing file or store, unwritable directory, port in use, a model or
  tokenizer id that is neither a local directory nor cached while offline, a preflight refusal) ends
  with exit 2 (config) or 1 and one line `prog: error: ...`; `--debug` (or FACTORY_DEBUG=1) also prints
  the traceback;
- Ctrl-C ends with one line `prog: interrupted` and exit 130 (the shell's code for SIGINT);
- anything else is a bug: its traceback is printed, then the same one-line summary.

Errors are recognised by class (anywhere in the exception's cause chain), so modules raise their own
error types and need not import this one; `UserError` is for code that has no error type of its own.
"""

from __future__ import annotations

import errno
import logging
import os
import socket
import sys
import traceback
from collections.abc import Callable, Sequence

DEBUG_FLAG = "--debug"
DEBUG_ENV = "FACTORY_DEBUG"


class UserError(Exception):
    """A fault the user can fix; the message names the value and the fix."""


# Error types whose message already names the value and the fix (matched by qualified class name, so this
# module imports none of them; subclasses count).
USER_ERROR_TYPES = {
    "factory.cli_errors.UserError": 1,
    "factory.config.ConfigError": 2,
    "pydantic_core._pydantic_core.ValidationError": 2,
    "factory.preflight.PreflightError": 1,
    "factory.store.StoreError": 1,
    "factory.local_prefect.StackError": 1,
    "factory.export.source.SourceError": 1,
    "factory.export.writer.OutputExistsError": 1,
    "factory.export.render.RenderError": 1,
    "factory.inference.health.EndpointsDown": 1,
    "factory.train.rl_plan.LoopInputError": 2,
    "factory.train.launch.LaunchError": 1,
}


def _qualname(cls: type) -> str:
    module = cls.__module__
    if module == "__main__":  # `python -m factory.local_prefect`: its classes live in __main__
        spec = getattr(sys.modules.get("__main__"), "__spec__", None)
        module = spec.name if spec is not None else module
    return f"{module}.{cls.__qualname__}"


def _chain(error: BaseException) -> list[BaseException]:
    seen: list[BaseException] = []
    node: BaseException | None = error
    while node is not None and node not in seen and len(seen) < 8:
        seen.append(node)
        node = node.__cause__ or node.__context__
    return seen


def _hub_id(error: BaseException) -> str | None:
    """The model/tokenizer id a failed `from_pretrained` was asked for, from the traceback's frames."""
    tb = error.__traceback__
    found = None
    while tb is not None:
        local = tb.tb_frame.f_locals
        for key in ("pretrained_model_name_or_path", "path_or_repo_id", "repo_id"):
            if isinstance(local.get(key), (str, os.PathLike)):
                found = str(local[key])
                break
        tb = tb.tb_next
    return found


def classify(error: BaseException) -> tuple[int, str] | None:
    """(exit code, one-line message) when `error` is a user error, else None (a bug: show the traceback)."""
    for node in _chain(error):
        for cls in type(node).__mro__:
            code = USER_ERROR_TYPES.get(_qualname(cls))
            if code is not None:
                return code, str(node).strip() or type(node).__name__
    for node in _chain(error):
        message = _os_error_message(node)
        if message:
            return 1, message
    return None


def _os_error_message(error: BaseException) -> str | None:
    modules = {cls.__module__.split(".")[0] for cls in type(error).__mro__}
    text = str(error)
    if "huggingface_hub" in modules or "couldn't connect to 'https://huggingface.co'" in text \
            or "is not a local folder and is not a valid model identifier" in text:
        name = _hub_id(error)
        what = f"'{name}'" if name else "the model or tokenizer"
        offline = os.environ.get("HF_HUB_OFFLINE") not in (None, "", "0", "false", "False")
        fix = ("give a local model directory (e.g. models/starter-policy), or put it in the Hugging Face cache "
               "on a machine that is online; HF_HUB_OFFLINE=1 is set" if offline
               else "check the id, or give a local model directory (e.g. models/starter-policy)")
        return f"{what} is neither a local directory nor a model on the Hugging Face hub cache: {fix}"
    if not isinstance(error, OSError):
        return None
    where = f" {error.filename}" if error.filename else ""
    if error.errno == errno.EADDRINUSE:
        return f"address already in use{where}: stop the process holding the port, or choose another with --port"
    if isinstance(error, FileNotFoundError):
        return f"no such file or directory:{where or ' ' + text}: check the path (or create it first)"
    if isinstance(error, PermissionError) or error.errno in (errno.EACCES, errno.EPERM, errno.EROFS):
        return f"permission denied:{where or ' ' + text}: choose a writable path or fix its permissions"
    if error.errno == errno.ENOSPC:
        return f"no space left on device{where}: free space or choose another store"
    return None


def check_port_free(host: str, port: int, *, flag: str = "--port") -> None:
    """Raise UserError naming the holder when (host, port) cannot be bound; port 0 is always free."""
    if port == 0:
        return
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind((host, port))
        except OSError as error:
            if error.errno != errno.EADDRINUSE:
                raise
            raise UserError(f"port {port} on {host} is already in use{_holder(port)}: stop that process, or pass "
                            f"{flag} with a free port") from None


def _holder(port: int) -> str:
    try:
        import psutil

        for conn in psutil.net_connections(kind="inet"):
            if conn.laddr and conn.laddr.port == port and conn.status == psutil.CONN_LISTEN and conn.pid:
                proc = psutil.Process(conn.pid)
                return f" by pid {conn.pid} ({' '.join(proc.cmdline())[:120]})"
    except Exception:  # naming the holder is a courtesy (it needs the right to see other users' sockets)
        return ""
    return ""


def run_cli(prog: str, main: Callable[[list[str]], int | None], argv: Sequence[str] | None = None) -> int:
    """Run `main(argv)`; return its exit code, turning user errors and Ctrl-C into one last line (see module doc)."""
    args = list(sys.argv[1:] if argv is None else argv)
    debug = DEBUG_FLAG in args or os.environ.get(DEBUG_ENV, "") not in ("", "0")
    args = [arg for arg in args if arg != DEBUG_FLAG]
    if debug:
        os.environ[DEBUG_ENV] = "1"  # flow runs of this command keep Prefect's tracebacks too
    try:
        code = main(args)
    except KeyboardInterrupt:
        if debug:
            traceback.print_exc()
        print(f"\n{prog}: interrupted", file=sys.stderr, flush=True)
        return 130
    except SystemExit:
        raise
    except BrokenPipeError:  # `cmd --help | head`: the reader left; nothing more to say
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0
    except Exception as error:
        known = classify(error)
        if known is None or debug:
            traceback.print_exc()
        if known is None:
            print(f"{prog}: error: {type(error).__name__}: {error}", file=sys.stderr, flush=True)
            return 1
        code, message = known
        hint = "" if debug else f" (--debug shows the traceback)" if code != 2 else ""
        print(f"{prog}: error: {message}{hint}", file=sys.stderr, flush=True)
        return code
    return int(code or 0)


FLOW_RUN_LOGGERS = ("prefect.flow_runs", "prefect.engine")
"""Where Prefect's engine logs a flow run's exception with its traceback (in the run's log and the worker's)."""


class OneLineUserErrors(logging.Filter):
    """Prefect logs a failed flow run's exception with its traceback, twice ('Encountered exception during
    execution', then 'Engine execution exited with unexpected exception'). For a user error (and for the
    FailedRun Prefect raises when a flow returned a Failed state with its own message) this keeps one line,
    `flow run failed: <message>`, without the traceback, and drops the repeat; bugs keep their tracebacks."""

    def __init__(self) -> None:
        super().__init__()
        self._said: BaseException | None = None

    def filter(self, record: logging.LogRecord) -> bool:
        error = record.exc_info[1] if record.exc_info else None
        if error is None or os.environ.get(DEBUG_ENV, "") not in ("", "0"):  # --debug: Prefect's tracebacks too
            return True
        known = classify(error)
        if known is None:
            if type(error).__name__ != "FailedRun" or type(error).__module__ != "prefect.exceptions":
                return True
            known = (1, str(error).strip() or "the flow returned a Failed state")
        if error is self._said:
            return False
        self._said = error
        record.msg, record.args, record.exc_info, record.exc_text = f"flow run failed: {known[1]}", (), None, None
        record.levelno, record.levelname = logging.ERROR, "ERROR"
        return True


def quiet_user_errors_in_flow_runs() -> None:
    """Install OneLineUserErrors on Prefect's flow-run loggers (once; it lets everything through under --debug)."""
    for name in FLOW_RUN_LOGGERS:
        logger = logging.getLogger(name)
        if not any(isinstance(f, OneLineUserErrors) for f in logger.filters):
            logger.addFilter(OneLineUserErrors())
