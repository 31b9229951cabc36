"""The job routes: OpenAI's `/v1/videos` job API for video models, its twin `/v1/images/jobs` for image models:
create, list, get, its content, its event stream (status, progress, previews) and delete. Every call into the
job database runs off the event loop, and a refusal by it is a 503."""

from __future__ import annotations

import asyncio
import sqlite3
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from fastapi import FastAPI, Request
from fastapi.responses import FileResponse, JSONResponse, StreamingResponse
from pydantic import BaseModel, ValidationError

from layerstream.server.bodies import (
    decode_base64_image, edit_refusals, json_body, read_body, read_form, read_urlencoded,
)  # fmt: skip
from layerstream.server.errors import ApiError, validation_error
from layerstream.server.jobs.manager import DEFAULT_PAGE, MAX_PAGE, JobManager
from layerstream.server.jobs.requests import ImageJobForm, ImageJobRequest, VideoJobForm, VideoJobRequest
from layerstream.server.openapi import (
    IMAGE_INPUT_ERRORS,
    QUEUEING_ERRORS,
    binary_response,
    error_responses,
    json_request_body,
)

if TYPE_CHECKING:
    from layerstream.server.service import GenerationService

_DATABASE_REFUSED = {503: "The job database refused the request (locked past its timeout, a disk error); retry later"}
_NO_JOB = {404: "No job of this id on this server", **_DATABASE_REFUSED}
_CREATE_ERRORS = error_responses({
    400: "The served model cannot take the request (size, frames, work, input image), or the body is neither JSON"
         " nor multipart",
    **QUEUEING_ERRORS,  # nothing is stored
    **IMAGE_INPUT_ERRORS,
    503: "The server is shutting down, a serving rank failed, or the job database refused the job's row",
    507: "The data folder is full: the job cannot be stored",
})  # fmt: skip
_LIST_ERRORS = error_responses(
    {400: "after names no job of this server", 422: "A query parameter unknown or invalid", **_DATABASE_REFUSED}
)
_PAGE_PARAMETERS = [
    {"name": "limit", "in": "query", "required": False,
     "schema": {"type": "integer", "minimum": 1, "maximum": MAX_PAGE, "default": DEFAULT_PAGE}},
    {"name": "after", "in": "query", "required": False, "schema": {"type": "string"},
     "description": "The id of the job the page starts after"},
    {"name": "order", "in": "query", "required": False, "schema": {"enum": ["asc", "desc"], "default": "desc"}},
]  # fmt: skip
_VARIANT_PARAMETER = {"name": "variant", "in": "query", "required": False, "schema": {"enum": ["video"]}}


class _ServedFile(FileResponse):
    """A job's output sent from the link made for this download, released when the response ends."""

    def __init__(self, path: Path, *, release: Callable[[Path], None], **kwargs: Any):
        super().__init__(path, **kwargs)
        self._served, self._release = path, release

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        # no `pathsend`: a server offered it would read the link after this returns, once it is gone
        extensions = {k: v for k, v in scope.get("extensions", {}).items() if k != "http.response.pathsend"}
        try:
            await super().__call__({**scope, "extensions": extensions}, receive, send)
        finally:
            await asyncio.to_thread(self._release, self._served)  # an unlink: off the event loop


def add_job_routes(app: FastAPI, jobs: JobManager) -> None:
    path = jobs.path
    is_video = jobs.kind == "video"
    strict_model, form_model = (VideoJobRequest, VideoJobForm) if is_video else (ImageJobRequest, ImageJobForm)

    @app.post(path, responses=_CREATE_ERRORS, openapi_extra=json_request_body(strict_model))
    async def create_job(request: Request) -> JSONResponse:
        body, image = await read_job_input(request, jobs.service, strict_model, form_model, f"POST {path}")
        return JSONResponse(await asyncio.to_thread(jobs.create, body, image))  # a database write

    @app.get(path, responses=_LIST_ERRORS, openapi_extra={"parameters": _PAGE_PARAMETERS})
    async def list_jobs(request: Request) -> JSONResponse:
        limit, after, order = _page_query(request)
        return JSONResponse(await _in_database(jobs.page, limit=limit, after=after, order=order))

    @app.get(path + "/{job_id}", responses=error_responses(_NO_JOB))
    async def get_job(job_id: str) -> JSONResponse:
        return JSONResponse(await _in_database(jobs.get, job_id))

    content_errors = {**_NO_JOB, 409: "The job has not completed", **({422: "variant is not 'video'"} if is_video else {})}
    content = binary_response("The output", "video/mp4" if is_video else "image/png")

    @app.get(
        path + "/{job_id}/content",
        response_class=FileResponse,
        responses={**content, **error_responses(content_errors)},
        openapi_extra={"parameters": [_VARIANT_PARAMETER]} if is_video else None,
    )
    async def get_content(job_id: str, request: Request) -> FileResponse:
        variant = request.query_params.get("variant")
        if is_video and variant not in (None, "video"):
            raise ApiError(422, f"variant = {variant!r} is not served; expected 'video'", code="invalid_request", param="variant")
        served, media_type, name = await _in_database(jobs.content, job_id)  # a read and a hard link
        return _ServedFile(served, media_type=media_type, filename=name, release=jobs.release_content)

    sse = {"text/event-stream": {"schema": {"type": "string"}}}
    events = {200: {"description": "Status, progress and preview events", "content": sse}, **error_responses(_NO_JOB)}

    @app.get(path + "/{job_id}/events", response_class=StreamingResponse, responses=events)
    async def job_events(job_id: str) -> StreamingResponse:
        await _in_database(jobs.get, job_id)  # a 404 before the stream starts
        # no-cache and no buffering: each event goes out as it happens, through proxies too
        headers = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
        return StreamingResponse(jobs.stream(job_id), media_type="text/event-stream", headers=headers)

    @app.delete(path + "/{job_id}", responses=error_responses(_NO_JOB))
    async def delete_job(job_id: str) -> JSONResponse:
        return JSONResponse(await _in_database(jobs.delete, job_id))  # a database write and an unlink


async def read_job_input(
    request: Request, service: GenerationService, strict_model: type[VideoJobRequest | ImageJobRequest],
    form_model: type[BaseModel], endpoint: str,
) -> tuple[Any, Any]:
    """(the parsed body, the input image read or None) of a JSON, multipart or url-encoded create request."""
    image_field = strict_model.image_field
    content_type = request.headers.get("content-type", "").lower()
    takes_image = service.limits.rules.image_input != "none"
    limit = service.settings.image_body_bytes if takes_image else service.settings.max_body_bytes
    flags = "--max-body-bytes plus --max-image-bytes" if takes_image else "--max-body-bytes"
    body = await read_body(request, limit, flags)
    if content_type.startswith("multipart/form-data"):
        model_name = service.limits.model
        # an image job with an input image is an edit, and refuses what an edit refuses
        refused = edit_refusals(model_name) if service.limits.kind == "image" and takes_image else None
        data, image_bytes = await read_form(request, body, image_field, model=model_name, refused=refused)
        model, parse = form_model, form_model.model_validate
    elif content_type.startswith("application/x-www-form-urlencoded"):  # a form without files (aiohttp's)
        data, image_bytes = await asyncio.to_thread(read_urlencoded, body, image_field)
        model, parse = form_model, form_model.model_validate
    elif content_type.startswith("application/json") or not content_type:
        model, parse = strict_model, strict_model.model_validate_json
        data, image_bytes = json_body(body), None
    else:
        message = f"expected an application/json, multipart/form-data or application/x-www-form-urlencoded body, got {content_type!r}"
        raise ApiError(400, message, code="invalid_body", param="body")
    try:
        parsed = await asyncio.to_thread(parse, data)  # a body of up to ~43 MB: parsed off the event loop
    except ValidationError as e:
        raise validation_error(e, model) from None
    inline = getattr(parsed, image_field, None)  # JSON: the image as base64 or a data URL
    if inline is not None:
        image_bytes = await asyncio.to_thread(decode_base64_image, inline, image_field)
    how = f"{image_field} (a file part, or base64 or a data URL in JSON)"
    service.check_image_presence(has_image=image_bytes is not None, endpoint=endpoint, field=image_field, how=how)
    image = await asyncio.to_thread(service.read_image, image_bytes, image_field) if image_bytes is not None else None
    return parsed, image


async def _in_database(function: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """`function(*args, **kwargs)`, a call into the job database, off the event loop; a 503 if it refuses."""
    try:
        return await asyncio.to_thread(function, *args, **kwargs)
    except sqlite3.Error as e:
        message = f"the job database refused the request ({type(e).__name__}: {e}); retry later"
        raise ApiError(503, message, code="database_error") from None


def _page_query(request: Request) -> tuple[int, str | None, Literal["asc", "desc"]]:
    query = request.query_params
    unknown = sorted(set(query) - {"limit", "after", "order"})
    if unknown:
        raise ApiError(422, f"unknown query parameter {unknown[0]!r}; expected limit, after, order", code="invalid_request", param=unknown[0])
    text = query.get("limit", str(DEFAULT_PAGE))
    if not text.isdigit() or not 1 <= int(text) <= MAX_PAGE:
        raise ApiError(422, f"limit = {text!r} is not valid; expected an integer from 1 to {MAX_PAGE}", code="invalid_request", param="limit")
    order = query.get("order", "desc")
    if order not in ("asc", "desc"):
        raise ApiError(422, f"order = {order!r} is not valid; expected 'asc' or 'desc'", code="invalid_request", param="order")
    return int(text), query.get("after") or None, order  # type: ignore[return-value]  # checked just above
