"""The pinned agent CLIs (Codex, Claude Code) run against a server on 127.0.0.1.

Shared by `tests/integration/test_agent_clis.py` (against our server) and `capture.py` (against
`recorder.Recorder`, for the first-request fixtures). Each run gets homes of its own under
the folder it is given (HOME, CODEX_HOME, the XDG folders), stdin from /dev/null, proxies
pointed at a closed port (so anything not on loopback fails at once; loopback is exempt)
and the CLIs' own switches for telemetry, update checks and other traffic turned off.

Where the CLIs are: ``$MNB_AGENT_CLIS`` (an npm prefix: the folder holding
``node_modules/.bin``), else ``tests/agents`` itself, where ``npm ci`` (`.ci/run`) installs
the versions `package.json` and `package-lock.json` pin.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import cache
from pathlib import Path

HERE = Path(__file__).resolve().parent
PINS = json.loads((HERE / "package.json").read_text())["dependencies"]
PACKAGES = {"codex": "@openai/codex", "claude": "@anthropic-ai/claude-code"}
INSTALL_HINT = "cd tests/agents && npm ci (what .ci/run does)"

# A port nothing listens on: the CLIs' proxy for every host but loopback (NO_PROXY), so a
# request meant for the internet fails at once instead of leaving the machine.
CLOSED_PROXY = "http://127.0.0.1:9"
UNREACHABLE_AFTER = 3  # Codex's "Reconnecting..." events before a run is ended
KEY_ENV = "MNB_AGENT_KEY"  # the variable Codex's provider reads its key from (env_key)

# Claude Code: no traffic but the model's requests (telemetry, error reports, update
# checks, the /api/hello reachability probe, feature flags), and bounded retries and waits.
CLAUDE_QUIET = {
    "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1",
    "DISABLE_TELEMETRY": "1",
    "DISABLE_ERROR_REPORTING": "1",
    "DISABLE_AUTOUPDATER": "1",
    "DISABLE_GROWTHBOOK": "1",
    "CLAUDE_CODE_DISABLE_TERMINAL_TITLE": "1",
}


def prefix() -> Path:
    given = os.environ.get("MNB_AGENT_CLIS")
    return Path(given).expanduser() if given else HERE


def path(name: str) -> Path:
    """Where the CLI `name` ("codex" or "claude") would be."""
    return prefix() / "node_modules" / ".bin" / name


@cache
def missing(name: str) -> str | None:
    """Why the pinned CLI `name` cannot run here (None: it can)."""
    exe = path(name)
    if not exe.exists():
        return f"{PACKAGES[name]} is not installed ({INSTALL_HINT})"
    try:
        out = subprocess.run(
            [str(exe), "--version"],
            capture_output=True,
            text=True,
            timeout=120,
            stdin=subprocess.DEVNULL,
            env={**os.environ, **CLAUDE_QUIET},
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"{PACKAGES[name]} does not start: {exc}"
    want = PINS[PACKAGES[name]]
    if want not in out.stdout:
        got = (out.stdout or out.stderr).strip().splitlines()[:1]
        return f"{PACKAGES[name]} is not {want} (--version: {got}; {INSTALL_HINT})"
    return None


def base_env(root: Path) -> dict[str, str]:
    """The environment of a CLI run: homes of its own under `root`, no proxy for loopback,
    a closed one for everything else, nothing of the caller's API keys."""
    home = root / "home"
    for sub in ("home", "xdg/config", "xdg/cache", "xdg/data", "xdg/state", "tmp"):
        (root / sub).mkdir(parents=True, exist_ok=True)
    keep = ("PATH", "LANG", "LC_ALL", "TZ", "SSL_CERT_FILE", "SYSTEMROOT")
    env = {k: v for k, v in os.environ.items() if k in keep}
    env.update(
        HOME=str(home),
        USERPROFILE=str(home),
        XDG_CONFIG_HOME=str(root / "xdg/config"),
        XDG_CACHE_HOME=str(root / "xdg/cache"),
        XDG_DATA_HOME=str(root / "xdg/data"),
        XDG_STATE_HOME=str(root / "xdg/state"),
        TMPDIR=str(root / "tmp"),
        TERM="dumb",
        NO_COLOR="1",
        CI="true",
    )
    for name in ("HTTP_PROXY", "HTTPS_PROXY", "ALL_PROXY"):
        env[name] = env[name.lower()] = CLOSED_PROXY
    env["NO_PROXY"] = env["no_proxy"] = "127.0.0.1,localhost,::1"
    return env


# -- Codex ------------------------------------------------------------------------------------


def codex_config(
    url: str,
    model: str,
    *,
    retries: int = 1,
    idle_timeout_ms: int = 600_000,
    context_window: int | None = None,
) -> str:
    """Codex's config.toml for a server at `url` (``http://127.0.0.1:PORT``): a provider of
    our own, the Responses API, `retries` retries of a request or a broken stream, a stream
    that may stay quiet `idle_timeout_ms`, and nothing sent anywhere else."""
    lines = [
        f'model = "{model}"',
        'model_provider = "mlx_nbengine"',
        "check_for_update_on_startup = false",
    ]
    if context_window is not None:
        lines.append(f"model_context_window = {context_window}")
    lines += [
        "",
        "[analytics]",
        "enabled = false",
        "",
        "[feedback]",
        "enabled = false",
        "",
        "[model_providers.mlx_nbengine]",
        'name = "mlx_nbengine"',
        f'base_url = "{url}/v1"',
        'wire_api = "responses"',
        f'env_key = "{KEY_ENV}"',
        f"request_max_retries = {retries}",
        f"stream_max_retries = {retries}",
        f"stream_idle_timeout_ms = {idle_timeout_ms}",
        "",
    ]
    return "\n".join(lines)


@dataclass
class CodexRun:
    returncode: int | None  # None: killed at the timeout
    events: list[dict]
    stdout: str
    stderr: str
    timed_out: bool = False
    unparsed: list[str] = field(default_factory=list)
    unreachable: bool = False  # ended by us: Codex kept failing to connect

    def of_type(self, kind: str) -> list[dict]:
        return [e for e in self.events if e.get("type") == kind]

    def errors(self) -> list[dict]:
        """Error events and error items, but Codex's notice that it has no metadata for
        the model's name (every model that is not OpenAI's gets it)."""
        found = [e for e in self.events if e.get("type") in ("error", "turn.failed")]
        for e in self.of_type("item.completed"):
            item = e.get("item", {})
            if item.get("type") == "error" and "metadata" not in str(item.get("message")):
                found.append(e)
        return found

    def usage(self) -> dict:
        done = self.of_type("turn.completed")
        return done[-1].get("usage", {}) if done else {}

    def text(self) -> str:
        items = [e.get("item", {}) for e in self.of_type("item.completed")]
        return "".join(i.get("text", "") for i in items if i.get("type") == "agent_message")

    def describe(self) -> str:
        """What happened, for a failure message: the exit, the errors, stderr's tail."""
        why = "timed out" if self.timed_out else f"exit {self.returncode}"
        if self.unreachable:
            why = f"stopped: no connection after {UNREACHABLE_AFTER} tries"
        errs = [json.dumps(e)[:600] for e in self.errors()]
        tail = "\n".join(self.stderr.strip().splitlines()[-15:])
        types = [e.get("type") for e in self.events]
        return f"codex {why}; events {types}; errors {errs}; stderr:\n{tail}"


def run_codex(
    url: str,
    prompt: str,
    root: Path,
    *,
    model: str,
    timeout: float,
    retries: int = 1,
    key: str = "unused",
    context_window: int | None = None,
    workdir: Path | None = None,
) -> CodexRun:
    """``codex exec --json`` once against `url`, its CODEX_HOME and HOME under `root`
    (reused by a later call with the same `root`: a second run in the same home)."""
    env = base_env(root)
    codex_home = root / "codex"
    codex_home.mkdir(exist_ok=True)
    (codex_home / "config.toml").write_text(
        codex_config(url, model, retries=retries, context_window=context_window)
    )
    env.update(CODEX_HOME=str(codex_home), RUST_LOG="error")
    env[KEY_ENV] = key
    work = workdir or root / "work"
    work.mkdir(exist_ok=True)
    cmd = [str(path("codex")), "exec", "--json", "--skip-git-repo-check", "--color", "never"]
    reconnects = 0

    def unreachable(line: str) -> bool:
        # Codex waits for the network without end when a connection fails ("Reconnecting...
        # waiting for network"), whatever its retry settings: the third such event ends it.
        nonlocal reconnects
        reconnects += '"type":"error"' in line and "Reconnecting" in line
        return reconnects >= UNREACHABLE_AFTER

    out, err, code, killed = _run([*cmd, prompt], env, work, timeout, unreachable)
    events, unparsed = [], []
    for line in out.splitlines():
        try:
            events.append(json.loads(line))
        except ValueError:
            unparsed.append(line)
    gave_up = killed and reconnects >= UNREACHABLE_AFTER
    return CodexRun(code, events, out, err, killed and not gave_up, unparsed, gave_up)


# -- Claude Code ------------------------------------------------------------------------------


def claude_env(
    url: str, root: Path, *, model: str, retries: int = 1, key: str = "unused", timeout_ms: int
) -> dict[str, str]:
    env = base_env(root)
    env.update(CLAUDE_QUIET)
    env.update(
        ANTHROPIC_BASE_URL=url,
        ANTHROPIC_API_KEY=key,
        ANTHROPIC_MODEL=model,
        ANTHROPIC_SMALL_FAST_MODEL=model,
        ANTHROPIC_DEFAULT_HAIKU_MODEL=model,
        ANTHROPIC_DEFAULT_SONNET_MODEL=model,
        ANTHROPIC_DEFAULT_OPUS_MODEL=model,
        CLAUDE_CODE_MAX_RETRIES=str(retries),
        API_TIMEOUT_MS=str(timeout_ms),
    )
    return env


@dataclass
class ClaudeRun:
    returncode: int | None
    stdout: str
    stderr: str
    timed_out: bool = False

    def result(self) -> dict | None:
        """The ``--output-format json`` result object (None: not JSON)."""
        try:
            found = json.loads(self.stdout)
        except ValueError:
            return None
        if isinstance(found, list):  # some versions print every message; the result last
            found = next((m for m in reversed(found) if m.get("type") == "result"), None)
        return found if isinstance(found, dict) else None

    def describe(self) -> str:
        why = "timed out" if self.timed_out else f"exit {self.returncode}"
        tail = "\n".join(self.stderr.strip().splitlines()[-15:])
        result = self.result()
        if result is not None:
            keys = ("is_error", "result", "api_error_status", "api_error", "terminal_reason")
            said = {k: result.get(k) for k in keys} | {"turns": result.get("num_turns")}
        else:
            said = self.stdout[-1500:]
        return f"claude {why}; result: {said!r}; stderr:\n{tail}"


def run_claude(
    url: str,
    prompt: str,
    root: Path,
    *,
    model: str,
    timeout: float,
    retries: int = 1,
    key: str = "unused",
    output_format: str = "json",
    extra_env: dict[str, str] | None = None,
) -> ClaudeRun:
    """``claude -p`` once against `url` (``http://127.0.0.1:PORT``, no ``/v1``)."""
    env = claude_env(
        url, root, model=model, retries=retries, key=key, timeout_ms=int(timeout * 1000)
    )
    env.update(extra_env or {})
    work = root / "work"
    work.mkdir(exist_ok=True)
    cmd = [str(path("claude")), "-p", "--output-format", output_format, "--model", model]
    out, err, code, timed_out = _run([*cmd, prompt], env, work, timeout)
    return ClaudeRun(code, out, err, timed_out)


# -- running ----------------------------------------------------------------------------------


def _run(
    cmd: list[str],
    env: dict,
    cwd: Path,
    timeout: float,
    give_up: Callable[[str], bool] | None = None,
) -> tuple[str, str, int | None, bool]:
    """Run `cmd` with stdin from /dev/null in a session of its own. At `timeout`, or at the
    first stdout line `give_up` says yes to, the whole session is killed (a CLI's children
    too); the last value says whether it was killed."""
    proc = subprocess.Popen(
        cmd,
        cwd=cwd,
        env=env,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    out: list[str] = []
    err: list[str] = []
    stop = threading.Event()

    def read_out() -> None:
        for line in proc.stdout:
            out.append(line)
            if give_up is not None and give_up(line):
                stop.set()
        stop.set()

    def read_err() -> None:
        err.append(proc.stderr.read())

    readers = [threading.Thread(target=f, daemon=True) for f in (read_out, read_err)]
    for t in readers:
        t.start()
    stop.wait(timeout)
    killed = False
    try:
        proc.wait(timeout=5 if stop.is_set() else 0.01)
    except subprocess.TimeoutExpired:
        killed = True
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.wait()
    for t in readers:
        t.join(timeout=10)
    return "".join(out), "".join(err), None if killed else proc.returncode, killed
