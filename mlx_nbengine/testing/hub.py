"""A Hugging Face hub cache laid out by hand, as huggingface_hub lays it out."""

from __future__ import annotations

import hashlib
import shutil
from pathlib import Path


def add_to_hub_cache(
    hub: str | Path,
    repo_id: str,
    files: list[Path],
    *,
    commit: str = "c" * 40,
    refs: tuple[str, ...] = ("main",),
) -> Path:
    """Lay `files` out in the hub cache `hub` as huggingface_hub does (blobs named by their
    hash, a snapshot of relative symlinks to them, `refs/<ref>` naming the commit) and
    return the snapshot folder; several commits of one repository share its blobs."""
    repo = Path(hub) / ("models--" + repo_id.replace("/", "--"))
    snapshot = repo / "snapshots" / commit
    snapshot.mkdir(parents=True)
    (repo / "blobs").mkdir(exist_ok=True)
    (repo / "refs").mkdir(exist_ok=True)
    for file in files:
        digest = hashlib.sha256(Path(file).read_bytes()).hexdigest()
        if not (repo / "blobs" / digest).exists():
            shutil.copy2(file, repo / "blobs" / digest)
        (snapshot / Path(file).name).symlink_to(Path("..", "..", "blobs", digest))
    for ref in refs:
        (repo / "refs" / ref).write_text(commit)
    return snapshot
