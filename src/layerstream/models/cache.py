"""Where layerstream keeps files it builds, and how a folder is published there without ever being half-written."""

from __future__ import annotations

import logging
import os
import secrets
import shutil
import time
from collections.abc import Callable
from pathlib import Path

from layerstream.errors import LayerstreamError
from layerstream.processes import owner_has_ended, owner_tag

logger = logging.getLogger(__name__)

CACHE_ENV_VAR = "LAYERSTREAM_CACHE"

# A build folder this old was left by a process that crashed: no build takes anywhere near this long. Used
# when the builder's liveness cannot be told (another host sharing the cache, or a name we did not write).
STALE_BUILD_SECONDS = 3600.0

_BUILD_SUFFIX = ".tmp-"


def cache_root() -> Path:
    """``$LAYERSTREAM_CACHE``, else ``$XDG_CACHE_HOME/layerstream``, else ``~/.cache/layerstream``."""
    if explicit := os.environ.get(CACHE_ENV_VAR):
        return Path(explicit).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg).expanduser() if xdg else Path.home() / ".cache") / "layerstream"


class CacheFolderError(LayerstreamError, OSError):
    """A cache folder that exists but is not what layerstream would have built there."""


def publish_folder(folder: Path, write: Callable[[Path], None], *, marker: str) -> bool:
    """Make `folder` exist as `write` fills a scratch sibling, renamed onto it in one step (the first of racing
    builders wins); `marker` is in every complete folder. True if this call built it, False if it was there."""
    if (folder / marker).is_file():
        return False
    folder.parent.mkdir(parents=True, exist_ok=True)
    _remove_stale_builds(folder)
    # mkdir (unlike mkdtemp's private 0700) honours the umask, so the published folder gets the same
    # permissions as anything else the user creates.
    build = _scratch_sibling(folder)
    try:
        build.mkdir()  # inside the try: a Ctrl-C the moment it exists still removes it
        write(build)
        if not (build / marker).is_file():
            raise CacheFolderError(f"{build}: the build wrote no {marker}")
        try:
            # A directory rename is atomic, and refuses to replace a non-empty directory: exactly one racing
            # process succeeds (an empty leftover directory is replaced).
            os.rename(build, folder)
        except OSError:
            if (folder / marker).is_file():
                return False  # another process published first; its copy is as good as ours
            raise CacheFolderError(
                f"{folder} exists but is not a complete build (no {marker}); delete it and retry"
            ) from None
        return True
    finally:
        if build.exists():
            shutil.rmtree(build, ignore_errors=True)


def discard_folder(folder: Path) -> None:
    """Remove `folder`, renamed away first so that others see it whole or absent, never half-deleted."""
    trash = _scratch_sibling(folder)
    try:
        os.rename(folder, trash)
    except FileNotFoundError:
        return  # another process discarded it first
    shutil.rmtree(trash, ignore_errors=True)


def _scratch_sibling(folder: Path) -> Path:
    """A sibling name unique to this call, whose `owner_tag` tells a later build if its maker runs."""
    return folder.parent / f".{folder.name}{_BUILD_SUFFIX}{owner_tag()}-{secrets.token_hex(4)}"


def _remove_stale_builds(folder: Path) -> None:
    """Delete scratch folders for `folder` whose process has ended or, where that cannot be told, old."""
    prefix = f".{folder.name}{_BUILD_SUFFIX}"
    now = time.time()
    for leftover in folder.parent.glob(f"{prefix}*"):
        try:
            dead = owner_has_ended(leftover.name[len(prefix):].rpartition("-")[0])
            if dead or (dead is None and now - leftover.stat().st_mtime > STALE_BUILD_SECONDS):
                logger.info("removing stale build folder %s", leftover)
                shutil.rmtree(leftover, ignore_errors=True)
        except OSError:
            continue  # vanished meanwhile, or not ours to stat: nothing to clean
