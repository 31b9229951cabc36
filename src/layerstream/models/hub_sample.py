"""The lossless form's stored fraction sampled from a Hub repository's weights by HTTP Range requests (4 MiB of a
component at most), priced as `models.coded_fraction` prices a local sample. Any failure (offline, an error, a
range answered with the whole file) stops the reading, and the plan keeps its estimate, saying why."""

from __future__ import annotations

import dataclasses
import re
import threading
from collections.abc import Collection
from concurrent.futures import ThreadPoolExecutor

import torch

from layerstream.errors import LayerstreamError
from layerstream.models.coded_fraction import (
    HUB_SAMPLE, CodedTensor, coded_entries, picked_tensors, run_spans, runs_tensor, tally_samples,
)  # fmt: skip
from layerstream.models.hub import HubSettings, component_safetensors, is_network_error
from layerstream.models.saved_dtypes import SafetensorsHeaderError, parse_safetensors_header
from layerstream.runtime.packing.lossless_code import ESTIMATED, CodedFraction
from layerstream.wording import first_line, format_bytes

HUB_CONNECTIONS = 8
"""Runs read at once: each a round trip to the Hub and a redirect to its CDN, a few KiB to 64 KiB."""


class _RangeNotServed(LayerstreamError, ConnectionError):
    """The server did not answer a range request with that range alone; caught here, never met by a caller."""


def hub_coded_fraction(repo_id: str, commit: str, components: Collection[str], variant: str | None = None) -> CodedFraction:
    """The stored fraction of `components`' 16-bit tensors from ranged reads; else the estimate, and why."""
    settings = HubSettings.from_environment()
    if settings.offline:
        return _estimate("HF_HUB_OFFLINE is set")
    try:
        reader = _RangedReader(repo_id, commit, settings.endpoint)
        per_component = _coded_tensors(reader, repo_id, commit, components, variant)
        picked = picked_tensors(per_component, HUB_SAMPLE)
        tally = tally_samples(zip(picked, reader.read_runs(picked)))
    except Exception as e:
        return _estimate(_why_not_sampled(e))
    if tally.coded_bytes == 0:
        return _estimate(f"no 16-bit tensor the code would hold in {', '.join(sorted(components))}")
    source = (
        f"sampled from the checkpoint's weights by ranged reads from the Hub ({format_bytes(reader.read_bytes)} "
        f"read, headers included: runs of {tally.which(per_component, components)}; nothing downloaded)"
    )
    return CodedFraction(tally.stored_bytes / tally.coded_bytes, True, source)


def _coded_tensors(
    reader: _RangedReader, repo_id: str, commit: str, components: Collection[str], variant: str | None
) -> list[list[CodedTensor]]:
    """Per component (in name order), the tensors the lossless form codes, from each file's header."""
    files = component_safetensors(repo_id, commit, components, variant)
    per_component = []
    for name in sorted(components):
        tensors: list[CodedTensor] = []
        for f in (f for f in files if f.name.split("/", 1)[0] == name):
            header, data_start = parse_safetensors_header(lambda o, n, f=f: reader.read(f.name, o, n), f"{repo_id}/{f.name}")
            tensors += coded_entries(header, data_start, f.size, f.name)
        per_component.append(tensors)
    return per_component


def _estimate(why: str) -> CodedFraction:
    return dataclasses.replace(ESTIMATED, source=f"{ESTIMATED.source}; the Hub's weights were not sampled: {why}")


def _why_not_sampled(error: Exception) -> str:
    """Why a sample could not be read, in words; an error that is none of a sample's failures passes through."""
    from huggingface_hub.errors import HfHubHTTPError, OfflineModeIsEnabled

    if isinstance(error, OfflineModeIsEnabled):
        return "huggingface_hub is offline"
    if isinstance(error, HfHubHTTPError):  # "404 Client Error." then what was not found, for which URL
        return "the Hub answered " + " ".join([line for line in str(error).splitlines() if line.strip()][:2])
    if isinstance(error, (_RangeNotServed, SafetensorsHeaderError)):
        return str(error)
    if is_network_error(error):
        return f"the Hub cannot be reached ({first_line(error)})"
    if isinstance(error, LayerstreamError):  # the repository's files refused (a variant it does not have)
        return first_line(error)
    raise error


class _RangedReader:
    """Byte ranges of a repository's files by Range requests through huggingface_hub's session."""

    def __init__(self, repo_id: str, commit: str, endpoint: str) -> None:
        from huggingface_hub.utils import build_hf_headers

        self.repo_id, self.commit, self.endpoint = repo_id, commit, endpoint
        self.read_bytes = 0
        self._lock = threading.Lock()  # the runs are read on several threads
        self._headers = {**build_hf_headers(), "Accept-Encoding": "identity"}  # the token; ranges of the file's own bytes

    def read(self, filename: str, offset: int, count: int) -> bytes:
        """`count` bytes from `offset`; `_RangeNotServed` (no body read) where not that range is served."""
        from huggingface_hub import constants, hf_hub_url
        from huggingface_hub.utils import get_session, hf_raise_for_status

        if count == 0:
            return b""
        url = hf_hub_url(self.repo_id, filename, revision=self.commit, endpoint=self.endpoint)
        last = offset + count - 1
        headers = {**self._headers, "Range": f"bytes={offset}-{last}"}
        with get_session().stream("GET", url, headers=headers, timeout=constants.HF_HUB_DOWNLOAD_TIMEOUT) as response:
            if response.status_code >= 400:
                response.read()  # an error answer is a short text: read it, so that the error can say it
                hf_raise_for_status(response)
            served = response.headers.get("Content-Range", "")
            if response.status_code != 206 or not re.fullmatch(rf"bytes {offset}-{last}/(\d+|\*)", served):
                # leaving the block closes the connection with the body unread: a whole file is never read
                raise _RangeNotServed(
                    f"{self.repo_id}/{filename}: asked for bytes {offset}-{last}, the server answered {response.status_code}"
                    f"{f' with {served}' if served else ' without Content-Range (the whole file)'}; stopped reading"
                )
            data = bytearray()
            for chunk in response.iter_bytes():
                data += chunk
                if len(data) > count:
                    break
        if len(data) != count:
            raise _RangeNotServed(f"{self.repo_id}/{filename}: asked for {count} bytes at {offset}, the server sent {len(data)}")
        with self._lock:
            self.read_bytes += count
        return bytes(data)

    def read_runs(self, tensors: list[CodedTensor]) -> list[torch.Tensor]:
        """Each tensor's runs as int16, `HUB_CONNECTIONS` at a time; the first failure stops and is raised."""
        spans = [run_spans(t, HUB_SAMPLE) for t in tensors]
        with ThreadPoolExecutor(HUB_CONNECTIONS, thread_name_prefix="hub-sample") as pool:
            futures = [[pool.submit(self.read, t.file, offset, count) for offset, count in s] for t, s in zip(tensors, spans)]
            try:
                return [runs_tensor([f.result() for f in runs]) for runs in futures]
            except BaseException:
                pool.shutdown(wait=True, cancel_futures=True)  # the runs not yet started are not read
                raise
