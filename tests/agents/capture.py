"""Write the first-request fixtures: run each pinned CLI once against `recorder.Recorder`.

    .venv/bin/python tests/agents/capture.py [codex|claude ...]

Best run with no network but loopback, so that nothing a CLI tries elsewhere gets an
answer (``unshare -rn sh -c 'ip link set lo up && .venv/bin/python tests/agents/capture.py'``);
the CLIs' proxies point at a closed port in any case (`clis.base_env`).

Writes ``tests/agents/<cli>_first_request.json``: the CLI and its version, every request
the run made (method and path, in order), and the first model request whole (method, path,
query, headers, body) with what is random or this machine's replaced: the run's folders by
``<cwd>``/``<home>``/``<codex_home>`` (and the cwd as Claude Code's project name), UUIDs by
numbered ones, the OS in a user agent or a prompt by ``<os>``, the device id, the port.
Nothing else is changed, so the fixtures are the CLIs' requests as the server gets them.
"""

from __future__ import annotations

import json
import re
import socket
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import clis  # noqa: E402
from recorder import MODEL, Recorder  # noqa: E402

PROMPT = "Reply with the single word OK."
UUID = re.compile(r"[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}")
MODEL_PATHS = {"codex": "/v1/responses", "claude": "/v1/messages"}


def sanitize(obj: object, root: Path, port: int) -> object:
    text = json.dumps(obj)
    for sub, name in (("work", "<cwd>"), ("codex", "<codex_home>"), ("home", "<home>")):
        text = text.replace(str(root / sub), name)
    text = text.replace(re.sub(r"[^A-Za-z0-9]", "-", str(root / "work")), "<cwd as a name>")
    text = text.replace(str(root), "<run>")
    text = text.replace(f"127.0.0.1:{port}", "127.0.0.1:<port>")
    numbers: dict[str, str] = {}

    def uuid(m: re.Match) -> str:
        n = numbers.setdefault(m.group(0), f"00000000-0000-4000-8000-{len(numbers) + 1:012d}")
        return n

    text = UUID.sub(uuid, text)
    # Codex's user agent: "(Debian 12.0.0; x86_64)"; Claude Code's prompt: "OS Version: ...".
    text = re.sub(r"\(([^;()]+); (x86_64|aarch64|arm64)\)", r"(<os>; \2)", text)
    text = re.sub(r"OS Version: [^\\]+", "OS Version: <os>", text)
    text = re.sub(r'(\\"device_id\\":\\")[0-9a-f]{16,}', r"\1<device id>", text)
    host = socket.gethostname()
    if host and len(host) > 3 and host in text:
        text = text.replace(host, "<host>")
    return json.loads(text)


def capture(name: str, out_dir: Path) -> Path:
    with tempfile.TemporaryDirectory(prefix=f"capture-{name}-") as scratch:
        root = Path(scratch).resolve()
        with Recorder(root / "requests.jsonl") as rec:
            if name == "codex":
                run = clis.run_codex(rec.url, PROMPT, root, model=MODEL, timeout=180, retries=0)
                ok = bool(run.of_type("turn.completed")) and not run.errors()
            else:
                run = clis.run_claude(rec.url, PROMPT, root, model=MODEL, timeout=180, retries=0)
                ok = run.returncode == 0
            requests = rec.requests()
        if not ok:
            raise SystemExit(f"{name}: the run against the recorder failed: {run.describe()}")
        first = next(r for r in requests if r["path"] == MODEL_PATHS[name])
        fixture = {
            "cli": clis.PACKAGES[name],
            "version": clis.PINS[clis.PACKAGES[name]],
            "prompt": PROMPT,
            "requests": [f"{r['method']} {r['path']}" for r in requests],
            "first": {
                "method": first["method"],
                "path": first["path"],
                "query": first["query"],
                "headers": dict(first["headers"]),
                "body": first["body"],
            },
        }
        fixture = sanitize(fixture, root, rec.port)
    target = out_dir / f"{name}_first_request.json"
    target.write_text(json.dumps(fixture, indent=1, ensure_ascii=False) + "\n")
    return target


def main(argv: list[str]) -> None:
    names = argv or ["codex", "claude"]
    for name in names:
        if why := clis.missing(name):
            raise SystemExit(f"{name}: {why}")
    for name in names:
        print(capture(name, HERE))


if __name__ == "__main__":
    main(sys.argv[1:])
