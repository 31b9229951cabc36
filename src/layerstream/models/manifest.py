"""Checksums of a folder layerstream built: a bit flip or a NaN in a cached safetensors file still loads, and the
model then draws garbage with exit code 0. Hashing costs milliseconds for the tiny models (under 1 MB each);
folders without a manifest (downloaded models) are not hashed at all."""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path

from layerstream.errors import LayerstreamError

MANIFEST_NAME = "layerstream-manifest.json"
MANIFEST_FORMAT = 1

_CHUNK_BYTES = 1 << 20


class CorruptFolderError(LayerstreamError, OSError):
    """A file of a folder differs from what its manifest recorded when the folder was built (or is missing)."""

    def __init__(self, folder: Path, problems: list[str]):
        self.folder = folder
        self.problems = problems
        super().__init__(f"{folder}: {'; '.join(problems)}")


@dataclass(frozen=True)
class FileRecord:
    num_bytes: int
    sha256: str


def write_manifest(folder: Path) -> Path:
    """Record the size and SHA-256 of every file under `folder` in `folder / MANIFEST_NAME`."""
    files = [p for p in sorted(folder.rglob("*")) if p.is_file() and p.name != MANIFEST_NAME]
    records = {p.relative_to(folder).as_posix(): _record(p) for p in files}
    manifest = {
        "format": MANIFEST_FORMAT,
        "files": {path: {"bytes": r.num_bytes, "sha256": r.sha256} for path, r in sorted(records.items())},
    }
    target = folder / MANIFEST_NAME
    target.write_text(json.dumps(manifest, indent=1) + "\n")
    return target


def has_manifest(folder: Path) -> bool:
    return (folder / MANIFEST_NAME).is_file()


def verify_manifest(folder: Path) -> None:
    """Raise `CorruptFolderError` naming every file the manifest lists that is missing or differs."""
    if not has_manifest(folder):
        raise CorruptFolderError(folder, [f"it has no {MANIFEST_NAME} (built before checksums were recorded)"])
    try:
        manifest = json.loads((folder / MANIFEST_NAME).read_text())
        files = manifest["files"]
        expected = {path: FileRecord(int(f["bytes"]), str(f["sha256"])) for path, f in files.items()}
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
        raise CorruptFolderError(folder, [f"{MANIFEST_NAME} is unreadable ({type(e).__name__})"]) from e
    problems = []
    for path, want in expected.items():
        file = folder / path
        if not file.is_file():
            problems.append(f"{path} is missing")
            continue
        # the size first: it is free, and catches a truncated file without reading it
        if file.stat().st_size != want.num_bytes or _record(file).sha256 != want.sha256:
            problems.append(f"{path} does not match the checksum recorded when it was built")
    if problems:
        raise CorruptFolderError(folder, problems)


def _record(file: Path) -> FileRecord:
    digest = hashlib.sha256()
    with file.open("rb") as f:
        while chunk := f.read(_CHUNK_BYTES):
            digest.update(chunk)
    return FileRecord(file.stat().st_size, digest.hexdigest())
