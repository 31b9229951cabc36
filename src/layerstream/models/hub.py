"""Models named by a Hugging Face Hub id (``"org/name"``): downloaded into huggingface_hub's cache (only what the
pipeline loads), or planned from the Hub's metadata alone. huggingface_hub's settings are read per call (it reads them
once, at import). Files are fetched by commit, so that a moving branch cannot mix two commits: hence our ref and
download loop (``snapshot_download`` would resolve the revision again, and not refuse a full disk)."""

from __future__ import annotations

import contextlib
import importlib
import json
import os
import re
import shutil
import sys
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from layerstream.errors import LayerstreamError
from layerstream.models.folder_check import (
    MODEL_INDEX, ModelLoadError, check_model_folder, index_components, pipeline_components,
)  # fmt: skip
from layerstream.models.weight_files import WEIGHT_INDEX, weight_file_key
from layerstream.wording import first_line, format_bytes

HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]+")

_COMMIT = re.compile(r"[0-9a-f]{40}")
_DEFAULT_ENDPOINT = "https://huggingface.co"
_DEFAULT_REVISION = "main"

_FORMATS = (".safetensors", ".bin")  # in the order diffusers prefers them


def looks_like_hub_id(model: object) -> bool:
    """Whether `model` is spelled like a Hub repository id (``org/name``)."""
    return isinstance(model, str) and HUB_ID.fullmatch(model) is not None


def names_hub_repo(model: object) -> bool:
    """Whether `model` is spelled ``org/name`` and is not an existing local path (which wins)."""
    return looks_like_hub_id(model) and not Path(model).expanduser().exists()


@dataclass(frozen=True)
class ModelSource:
    """Where a model's files come from: an embedded tiny model, a local folder, or a Hub snapshot."""

    model: str
    folder: Path
    origin: Literal["tiny", "folder", "hub"]
    revision: str | None = None
    """The Hub revision asked for (None: ``main``)."""
    commit: str | None = None
    variant: str | None = None
    """The weights variant diffusers loads (``"fp16"``); None: the plain weights."""
    components: tuple[tuple[str, str], ...] = ()
    """(name, file) of each component loaded from its own file instead (``--component``), the file as given."""

    @property
    def shown_name(self) -> str:
        """The model as a client may read it: as given, a folder by its own name (its path is no client's business)."""
        return Path(self.model).name if self.origin == "folder" else self.model

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"model": self.model, "origin": self.origin, "folder": str(self.folder)}
        if self.origin == "hub":
            out.update(revision=self.revision or _DEFAULT_REVISION, commit=self.commit)
        if self.variant is not None:
            out["variant"] = self.variant
        if self.components:
            out["components"] = dict(self.components)
        return out


@dataclass(frozen=True)
class HubSettings:
    """huggingface_hub's settings as the environment gives them now."""

    endpoint: str
    cache_dir: Path
    offline: bool

    @classmethod
    def from_environment(cls) -> HubSettings:
        env = os.environ
        home = Path(env.get("HF_HOME") or Path(env.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "huggingface")
        cache = Path(env.get("HF_HUB_CACHE") or env.get("HUGGINGFACE_HUB_CACHE") or home / "hub").expanduser()
        offline = (env.get("HF_HUB_OFFLINE") or env.get("TRANSFORMERS_OFFLINE") or "").upper() in {"1", "ON", "YES", "TRUE"}
        return cls(endpoint=(env.get("HF_ENDPOINT") or _DEFAULT_ENDPOINT).rstrip("/"), cache_dir=cache, offline=offline)

    def repo_dir(self, repo_id: str) -> Path:
        """The repository's folder in the cache (huggingface_hub's layout: ``models--org--name``)."""
        from huggingface_hub.file_download import repo_folder_name

        return self.cache_dir / repo_folder_name(repo_id=repo_id, repo_type="model")


@dataclass(frozen=True)
class RepoFile:
    """A file of a Hub repository at one commit, with what the Hub reports of it."""

    name: str
    size: int
    blob: str | None
    """The name its blob has in the cache (the LFS sha256, or the git blob id)."""


@dataclass(frozen=True)
class HubMetadata:
    """A pipeline described by the Hub's metadata alone, and what a download would fetch."""

    source: ModelSource
    tensor_dtypes: dict[str, dict[str, str]]
    files: list[RepoFile] = field(default_factory=list)
    cached: frozenset[str] = frozenset()
    """Of `files`, those whose bytes are already in the cache."""

    @property
    def total_nbytes(self) -> int:
        return sum(f.size for f in self.files)

    @property
    def download_nbytes(self) -> int:
        """What a download would still fetch (the total less what the cache holds)."""
        return sum(f.size for f in self.files if f.name not in self.cached)


def select_files(
    filenames: Iterable[str], index: Mapping[str, Any], variant: str | None = None, from_files: Iterable[str] = ()
) -> list[str]:
    """The files the pipeline loads: ``model_index.json``, each component's non-weight files and its weights in
    one format (safetensors, else ``.bin``), in `variant` where it has it; no weights for those `from_files`.
    Raises `ModelLoadError` where a component has weights only in a variant that was not asked for."""
    by_folder: dict[str, list[str]] = {}
    for name in filenames:
        folder, _, leaf = name.rpartition("/")
        by_folder.setdefault(folder, []).append(leaf)
    chosen = [MODEL_INDEX]
    for component in index_components(index):
        leaves = by_folder.get(component, [])
        weights = [leaf for leaf in leaves if weight_file_key(leaf) is not None]
        others = [leaf for leaf in leaves if weight_file_key(leaf) is None]
        fmt, picked_variant = _pick_weights(component, [weight_file_key(leaf) for leaf in weights], variant)
        for leaf in sorted(others + weights):
            key = weight_file_key(leaf)
            if key is None or (key == (fmt, picked_variant) and component not in from_files):
                chosen.append(f"{component}/{leaf}")
    return chosen


def _pick_weights(
    component: str, keys: list[tuple[str, str | None] | None], variant: str | None
) -> tuple[str | None, str | None]:
    present = {k for k in keys if k is not None}
    wanted = ([(f, variant) for f in _FORMATS] if variant else []) + [(f, None) for f in _FORMATS]
    for key in wanted:
        if key in present:
            return key
    variants = sorted({v for f, v in present if v and f in _FORMATS})
    if variants:
        raise ModelLoadError(
            f"component {component} has weights only in the variant(s) {', '.join(variants)}; pass "
            f"--variant {variants[0]} (variant={variants[0]!r} in Python)"
        )
    return None, None  # a component without loadable weights: diffusers reports it when it loads


def download_snapshot(
    repo_id: str,
    *,
    revision: str | None = None,
    variant: str | None = None,
    offline: bool | None = None,
    from_files: frozenset[str] = frozenset(),
) -> ModelSource:
    """The snapshot of `repo_id` at `revision`, first downloading what the pipeline loads and the cache lacks
    (offline or unreachable: the cached one). Raises `ModelLoadError` with one line saying what to do."""
    settings = HubSettings.from_environment()
    if settings.offline or offline:
        why = "HF_HUB_OFFLINE is set" if settings.offline else "it is read from the cache only"
        return _cached_source(repo_id, revision, variant, settings, why=why, from_files=from_files)
    with _hub_errors(repo_id, revision, settings):
        try:
            commit, wanted = _pipeline_files(repo_id, revision, variant, settings, from_files)
            unreachable = None
        except _NetworkError as e:
            unreachable = f"the Hub at {settings.endpoint} cannot be reached ({e})"
        if unreachable is not None:  # outside the handler: the network error is in the message, not a chain
            return _cached_source(repo_id, revision, variant, settings, why=unreachable, from_files=from_files)
        _check_free_space(repo_id, wanted, settings)
        _fetch_all(repo_id, wanted, commit, settings)
    _write_ref(repo_id, revision, commit, settings)
    folder = settings.repo_dir(repo_id) / "snapshots" / commit
    check_model_folder(folder)
    return ModelSource(repo_id, folder, "hub", revision, commit, variant)


def _write_ref(repo_id: str, revision: str | None, commit: str, settings: HubSettings) -> None:
    """Record which commit a branch or tag named (``refs/<name>``), so that an offline run finds the snapshot."""
    name = revision or _DEFAULT_REVISION
    if _COMMIT.fullmatch(name):
        return
    ref = settings.repo_dir(repo_id) / "refs" / name
    ref.parent.mkdir(parents=True, exist_ok=True)
    partial = ref.with_name(ref.name + ".partial")
    partial.write_text(commit)
    partial.replace(ref)


def fetch_plan_metadata(repo_id: str, *, revision: str | None = None, variant: str | None = None) -> HubMetadata:
    """What planning needs of `repo_id`: the pipeline's JSON files and its weights' safetensors headers."""
    settings = HubSettings.from_environment()
    if settings.offline:
        raise HubUnavailableError(
            f"model {repo_id}: planning from the Hub's metadata needs the network and HF_HUB_OFFLINE is set; "
            "unset it, or plan a downloaded folder"
        )
    from huggingface_hub import HfApi

    api = HfApi(endpoint=settings.endpoint)
    with _hub_errors(repo_id, revision, settings):
        try:
            commit, wanted = _pipeline_files(repo_id, revision, variant, settings)
        except _NetworkError as e:
            raise HubUnavailableError(
                f"model {repo_id}: cannot reach the Hub at {settings.endpoint} ({e}); planning from its metadata "
                "needs the network"
            ) from e
        dtypes: dict[str, dict[str, str]] = {}
        for f in wanted:
            if f.name.endswith(".json"):
                _fetch(repo_id, f.name, commit, settings)
            elif f.name.endswith(".safetensors"):
                header = api.parse_safetensors_file_metadata(repo_id, f.name, revision=commit)
                component = f.name.split("/", 1)[0]
                dtypes.setdefault(component, {}).update({k: v.dtype for k, v in header.tensors.items()})
    _write_ref(repo_id, revision, commit, settings)
    cached = frozenset(f.name for f in wanted if _blob_cached(repo_id, f, settings))
    folder = settings.repo_dir(repo_id) / "snapshots" / commit
    return HubMetadata(ModelSource(repo_id, folder, "hub", revision, commit, variant), dtypes, wanted, cached)


def component_safetensors(repo_id: str, commit: str, components: Iterable[str], variant: str | None = None) -> list[RepoFile]:
    """The safetensors files the pipeline loads from `components` of `repo_id` at `commit`, in name order."""
    _, wanted = _pipeline_files(repo_id, commit, variant, HubSettings.from_environment())
    folders = set(components)
    mine = [f for f in wanted if f.name.endswith(".safetensors") and f.name.split("/", 1)[0] in folders]
    return sorted(mine, key=lambda f: f.name)


class HubUnavailableError(ModelLoadError):
    """The Hub could not be asked (offline, unreachable) or will not show a gated repository to this machine."""


class _NetworkError(LayerstreamError, ConnectionError):
    """The Hub could not be reached (no route, refused, timed out)."""


def _pipeline_files(
    repo_id: str, revision: str | None, variant: str | None, settings: HubSettings, from_files: Iterable[str] = ()
) -> tuple[str, list[RepoFile]]:
    """(the commit `revision` names, the files of it the pipeline loads), fetching only ``model_index.json``."""
    commit, files = _repo_files(repo_id, revision, settings)
    index = json.loads(Path(_fetch(repo_id, MODEL_INDEX, commit, settings)).read_text())
    return commit, [files[name] for name in select_files(files, index, variant, from_files)]


def _repo_files(repo_id: str, revision: str | None, settings: HubSettings) -> tuple[str, dict[str, RepoFile]]:
    """(the commit `revision` names, every file of the repository at that commit)."""
    from huggingface_hub import HfApi

    try:
        info = HfApi(endpoint=settings.endpoint).model_info(repo_id, revision=revision, files_metadata=True)
    except Exception as e:
        if is_network_error(e):
            raise _NetworkError(first_line(e)) from e
        raise
    files = {}
    for sibling in info.siblings or []:
        blob = sibling.lfs.sha256 if sibling.lfs is not None else sibling.blob_id
        size = sibling.lfs.size if sibling.lfs is not None else (sibling.size or 0)
        files[sibling.rfilename] = RepoFile(sibling.rfilename, int(size or 0), blob)
    return str(info.sha), files


def _fetch(repo_id: str, filename: str, commit: str, settings: HubSettings) -> str:
    from huggingface_hub import hf_hub_download

    return hf_hub_download(repo_id, filename, revision=commit, cache_dir=settings.cache_dir, endpoint=settings.endpoint)


def _fetch_all(repo_id: str, files: list[RepoFile], commit: str, settings: HubSettings) -> None:
    """Download every file not yet in the snapshot: progress bars on a terminal, one line a file otherwise."""
    from huggingface_hub.utils import are_progress_bars_disabled, disable_progress_bars, enable_progress_bars

    snapshot = settings.repo_dir(repo_id) / "snapshots" / commit
    todo = [f for f in files if not (snapshot / f.name).is_file()]
    terminal = sys.stderr.isatty()
    bars_were_off = are_progress_bars_disabled()
    if not terminal:
        disable_progress_bars()
    try:
        for number, f in enumerate(todo, 1):
            if not terminal:
                print(f"layerstream: downloading {repo_id}/{f.name} ({format_bytes(f.size)}) [{number}/{len(todo)}]",
                      file=sys.stderr, flush=True)  # fmt: skip
            _fetch(repo_id, f.name, commit, settings)
    finally:
        if not terminal and not bars_were_off:
            enable_progress_bars()


def _check_free_space(repo_id: str, files: list[RepoFile], settings: HubSettings) -> None:
    needed = sum(f.size for f in files if not _blob_cached(repo_id, f, settings))
    where = settings.cache_dir
    while not where.exists() and where != where.parent:
        where = where.parent
    free = shutil.disk_usage(where).free
    if needed > free:
        raise ModelLoadError(
            f"model {repo_id}: the download needs {format_bytes(needed)} but the cache's filesystem ({settings.cache_dir}) "
            f"has {format_bytes(free)} free; free some space or point HF_HUB_CACHE (or HF_HOME) at a larger disk"
        )


def _blob_cached(repo_id: str, f: RepoFile, settings: HubSettings) -> bool:
    return f.blob is not None and (settings.repo_dir(repo_id) / "blobs" / f.blob).is_file()


def _cached_source(
    repo_id: str, revision: str | None, variant: str | None, settings: HubSettings, *, why: str, from_files: frozenset[str]
) -> ModelSource:
    """The cached snapshot of `revision` (a branch or tag through the cache's ``refs/``), read without a request."""
    from huggingface_hub import try_to_load_from_cache

    wanted = revision or _DEFAULT_REVISION
    index = try_to_load_from_cache(repo_id, MODEL_INDEX, cache_dir=settings.cache_dir, revision=wanted)
    if not isinstance(index, str):  # not cached (None), or cached as missing at that commit
        todo = "unset HF_HUB_OFFLINE and connect to the network" if settings.offline else "connect to the network"
        raise ModelLoadError(
            f"model {repo_id}: {why} and no snapshot of revision {wanted} is cached in {settings.cache_dir}; "
            f"{todo} to download it"
        )
    folder = Path(index).parent
    check_model_folder(folder)
    _check_weights_present(repo_id, folder, from_files)
    return ModelSource(repo_id, folder, "hub", revision, folder.name, variant)


def _check_weights_present(repo_id: str, folder: Path, from_files: frozenset[str]) -> None:
    """Refuse a snapshot of JSON files only (planning's) or a stopped download, naming the component."""
    import torch

    for name, (library, class_name) in pipeline_components(folder).items():
        try:
            cls = getattr(importlib.import_module(library), class_name)
        except (ImportError, AttributeError):
            continue  # the load names a class it cannot find
        if not (isinstance(cls, type) and issubclass(cls, torch.nn.Module)) or name in from_files:
            continue
        leaves = [p.name for p in (folder / name).iterdir()] if (folder / name).is_dir() else []
        shards = _indexed_shards(folder / name, leaves)
        has_weights = any(weight_file_key(leaf) is not None and WEIGHT_INDEX.fullmatch(leaf) is None for leaf in leaves)
        if not has_weights or any(not (folder / name / s).is_file() for s in shards):
            raise ModelLoadError(
                f"model {repo_id}: the cached snapshot {folder.name} has no complete weights for component {name} "
                "(a download that stopped, or a plan that fetched only metadata); connect to the network to finish it"
            )


def _indexed_shards(folder: Path, leaves: list[str]) -> set[str]:
    shards: set[str] = set()
    for leaf in leaves:
        if WEIGHT_INDEX.fullmatch(leaf):
            with contextlib.suppress(OSError, ValueError, AttributeError):
                shards.update(json.loads((folder / leaf).read_text()).get("weight_map", {}).values())
    return shards


@contextlib.contextmanager
def _hub_errors(repo_id: str, revision: str | None, settings: HubSettings) -> Iterator[None]:
    """huggingface_hub's errors as one `ModelLoadError` line, unchained (the chain was 100 lines)."""
    from huggingface_hub.errors import GatedRepoError, HfHubHTTPError, RepositoryNotFoundError, RevisionNotFoundError

    try:
        yield
    except GatedRepoError:
        raise HubUnavailableError(
            f"model {repo_id}: the repository is gated and this machine has no access to it; accept its terms at "
            f"{settings.endpoint}/{repo_id}, then log in (hf auth login) or set HF_TOKEN"
        ) from None
    except RepositoryNotFoundError:
        raise ModelLoadError(
            f"model {repo_id}: no such repository on the Hub at {settings.endpoint}, or it is private and this "
            "machine is not logged in; check the id, or log in (hf auth login) or set HF_TOKEN"
        ) from None
    except RevisionNotFoundError:
        raise ModelLoadError(
            f"model {repo_id}: revision {revision!r} does not exist; pass a branch, tag or commit of the repository"
        ) from None
    except HfHubHTTPError as e:
        raise ModelLoadError(f"model {repo_id}: the Hub answered {first_line(e)}") from None
    except Exception as e:
        if is_network_error(e):
            raise HubUnavailableError(
                f"model {repo_id}: the download stopped, the Hub at {settings.endpoint} cannot be reached "
                f"({first_line(e)}); run again to resume it"
            ) from None
        raise


def is_network_error(error: BaseException) -> bool:
    from huggingface_hub.errors import HfHubHTTPError

    if isinstance(error, HfHubHTTPError):
        return False
    module = type(error).__module__.split(".")[0]
    return module in {"httpx", "httpx2", "requests", "urllib3"} or isinstance(error, (ConnectionError, TimeoutError))
