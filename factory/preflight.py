"""Checks a job's settings before any work starts, so a wrong setting fails in seconds with one line naming it.

    preflight(cfg, mode="process")   # raises PreflightError("openai.base_url", "http://…", "not reachable: …")

What is checked: every inference endpoint answers (its health route) and, for
OpenAI-compatible servers (`openai.server_type` openai/vllm), lists `openai.model_name`; `env.tokenizer_name` is either an
existing local directory with tokenizer files or a hub id (a path-like value
that does not exist is an error, and in offline mode a hub id must be in the
local Hugging Face cache); the env's dataset is readable (`env.data_file` exists, or the hub dataset
`env.dataset_name` is cached when offline and the hub answers when online); a judge endpoint (`env.judge` or
`env.judge_block`) answers; the store root is writable; in serve mode the batching API answers. Retries are for transient faults during a run: a
setting that is wrong at start is reported once, not retried for minutes.
"""

from __future__ import annotations

import functools
import os
import re
import ssl
import tempfile
import time
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import httpx

from factory.slurm_cluster import NODE_LOCAL_HOST


@functools.cache
def tls() -> ssl.SSLContext:
    """One verifying TLS context per process for the checks' HTTP clients. httpx builds a new one for every Client
    or `httpx.get` (CA bundle loaded: ~25 ms of CPU), and preflight runs on every flow call: at the datagen bench's
    1000 groups per call that was ~25 us of CPU per group (issue 33)."""
    return httpx.create_ssl_context()

HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*(/[\w.-]+)?$")
TOKENIZER_FILES = ("tokenizer_config.json", "tokenizer.json", "tokenizer.model", "vocab.json")


class PreflightError(RuntimeError):
    """A setting that cannot work; `str()` is one line: the setting, its value and why."""

    def __init__(self, setting: str, value: Any, reason: str) -> None:
        self.setting, self.value, self.reason = setting, value, reason
        super().__init__(f"preflight: {setting}={value!r}: {reason}")


def _offline() -> bool:
    return any(os.environ.get(name, "").lower() in ("1", "true", "yes", "on")
               for name in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"))


def looks_like_path(value: str) -> bool:
    """Whether a model/tokenizer reference means a local directory rather than a hub id ('org/name')."""
    if value.startswith(("/", "./", "../", "~", ".\\")) or "\\" in value or value.endswith("/"):
        return True
    if value.count("/") >= 2 or Path(value).exists():
        return True
    # 'models/starter-policy' names a local dir when ./models exists; a hub org is never also a local dir here.
    return "/" in value and Path(value.split("/", 1)[0]).is_dir()


def _in_hf_cache(repo_id: str) -> bool:
    try:
        from huggingface_hub.constants import HF_HUB_CACHE
    except ImportError:  # pragma: no cover - transformers always brings it
        return False
    return (Path(HF_HUB_CACHE) / f"models--{repo_id.replace('/', '--')}").is_dir()


def check_model_ref(setting: str, value: str, *, needs: tuple[str, ...] = TOKENIZER_FILES) -> None:
    """A local directory holding one of `needs`, or a hub id (cached, in offline mode)."""
    if looks_like_path(value):
        path = Path(value).expanduser()
        if not path.exists():
            raise PreflightError(setting, value, f"no such directory ({path.absolute()}); give the policy "
                                 "directory or a hub id like 'org/name'")
        if not path.is_dir():
            raise PreflightError(setting, value, "is a file, not a model directory")
        if needs and not any((path / name).is_file() for name in needs):
            raise PreflightError(setting, value, f"directory has none of {', '.join(needs)}")
        return
    if not HUB_ID.match(value):
        raise PreflightError(setting, value, "is neither an existing directory nor a hub id like 'org/name'")
    if _offline() and not _in_hf_cache(value):
        raise PreflightError(setting, value, "is a hub id that is not in the local Hugging Face cache and "
                             "HF_HUB_OFFLINE/TRANSFORMERS_OFFLINE is set; give a local directory or download it first")


def check_store_writable(setting: str, root: str) -> None:
    """The store root can be created and written (a temp file is written, fsynced and removed); for an object store
    URL, the bucket exists and a probe object can be written and removed (a StoreError names what is wrong)."""
    if "://" in root and not root.startswith("file://"):
        from factory.store_object import open_store

        open_store(root).check_writable()
        return
    path = Path(root)
    try:
        path.mkdir(parents=True, exist_ok=True)
        fd, name = tempfile.mkstemp(prefix=".preflight-", dir=path)
        try:
            os.write(fd, b"ok")
            os.fsync(fd)
        finally:
            os.close(fd)
            os.unlink(name)
    except OSError as error:
        raise PreflightError(setting, root, f"not writable ({type(error).__name__}: {error.strerror or error})") from None


def _served_models(data: Any) -> list[str]:
    if isinstance(data, dict) and isinstance(data.get("data"), list):
        return [str(m.get("id")) for m in data["data"] if isinstance(m, dict)]
    return []


def check_endpoint(url: str, *, server_type: str = "sglang", model_name: str = "default", timeout: float = 5.0,
                   headers: dict[str, str] | None = None, setting: str = "openai.base_url") -> None:
    """One inference endpoint answers its health route and, if a model name is set, serves that model."""
    from factory.inference.endpoints import endpoint_root

    root = endpoint_root(url)
    with httpx.Client(timeout=timeout, headers=headers, verify=tls()) as http:
        try:
            if server_type == "sglang":
                health = http.get(f"{root}/health")
                if health.status_code != 200:
                    raise PreflightError(setting, url, f"{root}/health answers HTTP {health.status_code}; "
                                         "is the inference server still starting?")
            models = http.get(f"{root}/v1/models")
        except httpx.HTTPError as error:
            raise PreflightError(setting, url, f"not reachable ({type(error).__name__}: {error or 'no answer'} "
                                 f"within {timeout:g}s); start the inference server or fix the URL") from None
    if server_type != "sglang" and models.status_code != 200:
        raise PreflightError(setting, url, f"{root}/v1/models answers HTTP {models.status_code}")
    # SGLang's /generate ignores the model name; OpenAI-compatible servers (vLLM) refuse a name they don't serve.
    if server_type != "sglang" and model_name != "default":
        served = _served_models(models.json())
        if served and model_name not in served:
            raise PreflightError("openai.model_name", model_name, f"not served by {root} (it serves {', '.join(served)})")


def check_api(setting: str, url: str, *, timeout: float = 5.0) -> None:
    """The batching API answers GET /info."""
    try:
        response = httpx.get(f"{url.rstrip('/')}/info", timeout=timeout, verify=tls())
    except httpx.HTTPError as error:
        raise PreflightError(setting, url, f"batching API not reachable ({type(error).__name__}); start "
                             "`run-api` or fix the URL") from None
    if response.status_code >= 500 or response.status_code == 404:
        raise PreflightError(setting, url, f"{url.rstrip('/')}/info answers HTTP {response.status_code}; "
                             "is this the batching API?")


def _datasets_cache_dirs(name: str) -> list[Path]:
    """Where `datasets` and the hub client keep a downloaded hub dataset."""
    hf_home = Path(os.environ.get("HF_HOME", Path.home() / ".cache" / "huggingface")).expanduser()
    datasets_cache = Path(os.environ.get("HF_DATASETS_CACHE", hf_home / "datasets")).expanduser()
    try:
        from huggingface_hub.constants import HF_HUB_CACHE
        hub_cache = Path(HF_HUB_CACHE)
    except ImportError:  # pragma: no cover - datasets always brings it
        hub_cache = hf_home / "hub"
    return [datasets_cache / name.replace("/", "___"), hub_cache / f"datasets--{name.replace('/', '--')}"]


def check_dataset(env: Any, *, timeout: float = 5.0) -> None:
    """The env's rows can be read: `env.data_file` exists, or the hub dataset `env.dataset_name` is reachable.

    Offline (HF_HUB_OFFLINE) a hub dataset must already be cached; online the hub must answer within `timeout`
    (otherwise `datasets` retries for minutes before the run fails).
    """
    data_file = getattr(env, "data_file", None)
    name = getattr(env, "dataset_name", None)
    if data_file:
        if not Path(data_file).is_file():
            raise PreflightError("env.data_file", data_file, f"no such file ({Path(data_file).absolute()}); point "
                                 "it at a local JSONL of the env's rows")
        return
    if not name:
        return
    if looks_like_path(name):
        if not Path(name).exists():
            raise PreflightError("env.dataset_name", name, f"no such directory ({Path(name).absolute()})")
        return
    fix = "download it once with network (datasets.load_dataset) or set env.data_file to a local JSONL"
    if _offline():
        if not any(path.is_dir() for path in _datasets_cache_dirs(name)):
            raise PreflightError("env.dataset_name", name, "is a hub dataset that is not in the local cache and "
                                 f"HF_HUB_OFFLINE/TRANSFORMERS_OFFLINE is set; {fix}")
        return
    endpoint = os.environ.get("HF_ENDPOINT", "https://huggingface.co").rstrip("/")
    try:
        answer = httpx.get(f"{endpoint}/api/datasets/{name}", timeout=timeout, verify=tls())
    except httpx.HTTPError as error:
        cached = any(path.is_dir() for path in _datasets_cache_dirs(name))
        hint = "it is cached: set HF_HUB_OFFLINE=1 to use the copy" if cached else fix
        raise PreflightError("env.dataset_name", name, f"the hub ({endpoint}) is not reachable "
                             f"({type(error).__name__}); {hint}") from None
    if answer.status_code in (401, 404):
        raise PreflightError("env.dataset_name", name, f"the hub has no dataset by this name (HTTP "
                             f"{answer.status_code}); fix the id or set env.data_file")


def check_judge(env: Any, *, timeout: float = 5.0) -> None:
    """An env that scores with a judge model (`env.judge` / `env.judge_block`) can reach its judge endpoint."""
    if not hasattr(env, "judge_block"):
        return
    block = getattr(env, "judge_block", None)
    if block:
        try:
            from blocks.inference import InferenceEndpointsBlock

            judge = InferenceEndpointsBlock.load(block).inference_config()
        except ValueError as error:
            raise PreflightError("env.judge_block", block, f"no such block ({error}); save an "
                                 "InferenceEndpointsBlock for the judge or set env.judge.base_url") from None
        setting = "env.judge_block"
    else:
        judge = getattr(env, "judge", None)
        setting = "env.judge.base_url"
        if judge is None:
            raise PreflightError(setting, None, "this env scores with a judge model; set env.judge.base_url (an "
                                 "OpenAI-compatible server) or env.judge_block")
    headers = {"Authorization": f"Bearer {judge.api_key}"}
    for url in judge.urls:
        try:
            check_endpoint(url, server_type=judge.server_type, model_name=judge.model_name, timeout=timeout,
                           headers=headers, setting=setting)
        except PreflightError as error:
            if "not reachable" in error.reason:
                raise PreflightError(setting, url, f"the judge endpoint is not reachable within {timeout:g}s; start "
                                     "a judge server there, or point env.judge.base_url / env.judge_block at "
                                     "one") from None
            raise


def _with_wait(check: Any, wait_s: float) -> None:
    """Run `check` until it passes or `wait_s` seconds have passed (0: once); re-raise the last PreflightError."""
    deadline = time.monotonic() + wait_s
    while True:
        try:
            return check()
        except PreflightError:
            if time.monotonic() >= deadline:
                raise
            time.sleep(1.0)


def preflight(cfg: Any, *, mode: str = "process", wait_s: float = 0.0, timeout: float = 5.0) -> None:
    """Check a datagen JobConfig before any work; raises the first PreflightError found.

    Endpoints are checked last so the cheap local checks answer first; with `wait_s` > 0 unreachable
    endpoints/APIs are polled that long (servers still starting on a cluster) before failing.
    """
    d, env, openai = cfg.datagen, cfg.env, cfg.openai
    check_store_writable("datagen.store_root", d.store_root)
    if "://" in d.store_root and not d.store_root.startswith("file://"):  # an object store: run files stay local
        from factory.datagen.store import DEFAULT_RUN_FILES_DIR

        check_store_writable("datagen.run_files_dir", getattr(d, "run_files_dir", None) or DEFAULT_RUN_FILES_DIR)
    sampling_api = getattr(d, "sampling_api", "auto")
    generate = sampling_api == "generate" or (sampling_api == "auto" and openai.server_type == "sglang")
    if env.tokenizer_name:
        check_model_ref("env.tokenizer_name", env.tokenizer_name)
    elif generate:
        raise PreflightError("env.tokenizer_name", None, "token in/out sampling (/generate) needs the policy's "
                             "tokenizer; set it to the policy directory or hub id")
    check_dataset(env, timeout=timeout)
    headers = {"Authorization": f"Bearer {openai.api_key}"}
    for url in openai.urls:
        if urlsplit(url).netloc == NODE_LOCAL_HOST:
            continue  # each SLURM worker's own node server: its job prologue waits for /health before the worker starts
        _with_wait(lambda url=url: check_endpoint(url, server_type=openai.server_type, model_name=openai.model_name,
                                                  timeout=timeout, headers=headers), wait_s)
    _with_wait(lambda: check_judge(env, timeout=timeout), wait_s)
    if mode == "serve" and cfg.serve.api_url:
        _with_wait(lambda: check_api("serve.api_url", cfg.serve.api_url, timeout=timeout), wait_s)


def check_reachable(setting: str, url: str, *, fix: str, timeout: float = 5.0) -> None:
    """Something answers HTTP at `url`'s root (any status): the server is up, whatever its routes."""
    from factory.inference.endpoints import endpoint_root

    root = endpoint_root(url)
    try:
        httpx.get(f"{root}/health", timeout=timeout, verify=tls())
    except httpx.HTTPError as error:
        raise PreflightError(setting, url, f"not reachable ({type(error).__name__}); {fix}") from None


def preflight_trainer(cfg: Any, *, timeout: float = 5.0) -> None:
    """Check a TrainJobConfig before any work: the policy directory, the batch source and the push endpoints, so
    a trainer started without run-api or the policy server fails in seconds instead of waiting `max_wait_s`."""
    check_model_ref("train.model_path", cfg.train.model_path, needs=("config.json",))
    if cfg.source.kind == "api":
        check_api("source.api_url", cfg.source.api_url, timeout=timeout)
    for url in cfg.push.endpoints:
        if urlsplit(url).netloc == NODE_LOCAL_HOST:
            continue  # a SLURM node's own server, not reachable from here
        check_reachable("push.endpoints", url, timeout=timeout,
                        fix="start the policy server (`factory-policy-server --model models/starter-policy "
                            "--port 30000`) or give push.endpoints '[]'")


def check_atropos_python(setting: str, python: str, *, timeout: float = 20.0) -> None:
    """`python` runs and can import atroposlib (the env's own venv)."""
    import subprocess

    probe = "import importlib.util, sys; sys.exit(importlib.util.find_spec('atroposlib') is None)"
    fix = ("build the Atropos venv (`python -m bench.atropos_venv`, or pip install atroposlib into a venv) and give "
           "its python as env.python or $ATROPOS_PYTHON")
    try:
        result = subprocess.run([python, "-c", probe], capture_output=True, timeout=timeout)
    except (OSError, subprocess.TimeoutExpired) as error:
        raise PreflightError(setting, python, f"cannot run it ({type(error).__name__}); {fix}") from None
    if result.returncode != 0:
        raise PreflightError(setting, python, f"has no atroposlib; {fix}")


def preflight_atropos_env(config: Any, *, local: bool = True, timeout: float = 5.0) -> None:
    """Check an AtroposEnvConfig before starting the env: its script, its venv's atroposlib (`local`: the process
    runs on this machine), run-api and the inference server, so none of them fails as a retried process death."""
    if not Path(config.script).is_file():
        raise PreflightError("env.script", config.script, "no such file; give the path of the Atropos env script")
    if local:
        check_atropos_python("env.python", config.python or os.environ.get("ATROPOS_PYTHON") or "python")
    check_api("env.api_url", config.api_url, timeout=timeout)
    if config.inference_url and urlsplit(config.inference_url).netloc != NODE_LOCAL_HOST:
        check_reachable("env.inference_url", config.inference_url, timeout=timeout,
                        fix="start the policy server or SGLang, or fix the URL")


def check_slurm_client(setting: str, value: Any) -> None:
    """sbatch and sinfo are on PATH: the flow runs on a SLURM head node."""
    import shutil

    missing = [tool for tool in ("sbatch", "sinfo") if shutil.which(tool) is None]
    if missing:
        raise PreflightError(setting, value, f"{' and '.join(missing)} not on PATH: run this flow on a SLURM head node "
                             "(a work pool whose worker has the SLURM client), or use a local launcher")
