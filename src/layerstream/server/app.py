"""The FastAPI app: routes, error answers and request metrics around a `GenerationService`: OpenAI's image, edit and
video endpoints, vllm-omni's ``/v1/videos/sync``, the job API (`jobs.routes`), ``/v1/models``, ``/health``, ``/metrics``
and the web page. A client that disconnects is counted as 499 (no client reads it: not in the OpenAPI document); its job
is dropped from the queue or stopped at its next step."""

from __future__ import annotations

import asyncio
import base64
import json
import logging
import time
import uuid
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from pydantic import BaseModel, ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.routing import Match, Route
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from layerstream import __version__
from layerstream.request import GenerationError
from layerstream.server.access import AccessSettings, add_access_checks
from layerstream.server.bodies import decode_base64_image, edit_refusals, json_body, read_form
from layerstream.server.bodies import read_body as _read_body
from layerstream.server.errors import ApiError, client_line, validation_error
from layerstream.server.jobs.manager import JobManager
from layerstream.server.jobs.records import run_figures
from layerstream.server.jobs.requests import VideoJobForm, VideoJobRequest
from layerstream.server.jobs.routes import add_job_routes, read_job_input
from layerstream.server.image_outputs import KeptOutputs
from layerstream.server.metrics import CONTENT_TYPE as METRICS_CONTENT_TYPE
from layerstream.server.metrics import ServerMetrics
from layerstream.server.openapi import (
    IMAGE_INPUT_ERRORS,
    QUEUEING_ERRORS,
    apply_exact_openapi_,
    binary_response,
    edit_request_body,
    error_responses,
    json_request_body,
)
from layerstream.server.queue import Job, QueueClosedError, QueueFullError, QueueTimeoutError
from layerstream.server.schemas import (
    GenerationBody,
    HealthResponse,
    ImageData,
    ImageEditRequest,
    ImageGenerationRequest,
    ImageGenerationResponse,
    ModelCard,
    ModelList,
    VideoData,
    VideoGenerationRequest,
    VideoGenerationResponse,
)
from layerstream.server.service import GenerationOutput, GenerationService, ServedRequest
from layerstream.server.stopping import GenerationStopped, StopReason
from layerstream.server.ui import add_web_page
from layerstream.wording import format_bytes

logger = logging.getLogger(__name__)

VIDEOS_SYNC_PATH = "/v1/videos/sync"
MODELS_PATH = "/v1/models"

_GENERATION_ERRORS = error_responses({
    400: "The served model cannot take the request (its endpoint, size, frames, work, input image), or the body is not"
         " what the endpoint reads (JSON, or the edit's multipart form)",
    **QUEUEING_ERRORS,
    500: "The generation raised (the server stays up)",
    504: "The request ran past its timeout (waiting, or generating)",
})  # fmt: skip
_IMAGE_INPUT_GENERATION_ERRORS = {**_GENERATION_ERRORS, **error_responses(IMAGE_INPUT_ERRORS)}
_IMAGE_OUTPUT_ERRORS = error_responses({404: "No kept output of that name (kept in memory, the newest only)"})


def create_app(
    service: GenerationService, jobs: JobManager | None = None, *, ui: bool = True, access: AccessSettings | None = None
) -> FastAPI:
    """The app serving `service`, with `jobs` its job API, with `ui` the web page (`access`: loopback's checks)."""
    access = access if access is not None else AccessSettings()
    app = FastAPI(title="layerstream", version=__version__, lifespan=_lifespan(service, jobs))
    apply_exact_openapi_(app, access)
    add_access_checks(app, access)
    app.add_middleware(RequestMetricsMiddleware, metrics=service.metrics)  # outermost: refusals are counted too

    @app.exception_handler(ApiError)
    async def api_error(request: Request, error: ApiError) -> JSONResponse:
        return JSONResponse(error.body(), status_code=error.status, headers=error.headers)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, error: StarletteHTTPException) -> JSONResponse:
        code = {404: "not_found", 405: "method_not_allowed"}.get(error.status_code, "http_error")
        body = ApiError(error.status_code, f"{request.method} {request.url.path}: {error.detail}", code=code).body()
        headers = getattr(error, "headers", None)
        if error.status_code == 405:  # Starlette's Allow names the first route of the path only
            headers = {**(headers or {}), "Allow": ", ".join(sorted(_served_methods(app, request.scope)))}
        return JSONResponse(body, status_code=error.status_code, headers=headers)

    @app.exception_handler(Exception)
    async def unexpected_error(request: Request, error: Exception) -> JSONResponse:
        # a bug in the server itself, not in a generation: still one line in the usual shape
        logger.exception("unexpected error answering %s %s", request.method, request.url.path)
        body = ApiError(500, f"internal error: {type(error).__name__}", code="internal_error").body()
        return JSONResponse(body, status_code=500)

    _add_image_routes(app, service)

    @app.post("/v1/videos/generations", response_model=VideoGenerationResponse,
              responses=_IMAGE_INPUT_GENERATION_ERRORS, openapi_extra=json_request_body(VideoGenerationRequest))
    async def create_videos(request: Request) -> JSONResponse:
        _, output = await _run_generation(service, request, VideoGenerationRequest, "video")
        data = [VideoData(b64_json=_base64(f)) for f in output.files]
        return _ok(VideoGenerationResponse(created=int(time.time()), data=data, layerstream=output.usage))

    if service.limits.kind == "video":
        _add_video_sync_route(app, service)
    if jobs is not None:
        add_job_routes(app, jobs)
    if ui:
        add_web_page(app)  # without the job API it says so, and its form stays off

    _add_model_routes(app, service)

    @app.get("/health", response_model=HealthResponse)
    async def health() -> dict[str, Any]:
        return {**service.health(), **(jobs.health() if jobs is not None else {})}

    @app.get("/metrics", response_class=PlainTextResponse)
    async def metrics() -> PlainTextResponse:
        return PlainTextResponse(service.render_metrics(), media_type=METRICS_CONTENT_TYPE)

    return app


def _add_model_routes(app: FastAPI, service: GenerationService) -> None:
    """OpenAI's ``GET /v1/models`` (what OpenAI-compatible clients ask first) and ``GET /v1/models/{model}``."""
    started = int(time.time())
    cards = {name: ModelCard(id=name, created=started) for name in service.limits.model_names}
    no_model = error_responses({404: "No served model of that name (--served-model-name)"})

    @app.get(MODELS_PATH, response_model=ModelList)
    async def list_models() -> ModelList:
        return ModelList(data=list(cards.values()))

    @app.get(MODELS_PATH + "/{model}", response_model=ModelCard, responses=no_model)
    async def get_model(model: str) -> ModelCard:
        if model not in cards:
            message = f"no model {model!r} is served here; served: {', '.join(map(repr, cards))} (--served-model-name)"
            raise ApiError(404, message, code="model_not_found", param="model")
        return cards[model]


def _add_video_sync_route(app: FastAPI, service: GenerationService) -> None:
    """vllm-omni's ``POST /v1/videos/sync``: the job API's body, answered with the MP4 and vllm-omni's headers."""
    responses = {**binary_response("The video", "video/mp4"), **_IMAGE_INPUT_GENERATION_ERRORS}
    request_body = json_request_body(VideoJobRequest)

    @app.post(VIDEOS_SYNC_PATH, response_class=Response, responses=responses, openapi_extra=request_body)
    async def create_video_sync(request: Request) -> Response:
        started = time.perf_counter()
        body, image = await read_job_input(request, service, VideoJobRequest, VideoJobForm, f"POST {VIDEOS_SYNC_PATH}")
        served = service.prepare(body.generation_body(service.limits), image, VideoJobRequest.image_field)
        output = await _submit_and_wait(service, request, served)
        usage, figures = output.usage, run_figures(output.usage)
        stages = {"queue": round(usage.queue_seconds, 6), "inference": figures["inference_time_s"], "total": round(time.perf_counter() - started, 6)}
        headers = {
            "x-request-id": uuid.uuid4().hex, "x-model": service.limits.model,
            "x-inference-time-s": str(figures["inference_time_s"]), "x-stage-durations": json.dumps(stages),
            **({"x-peak-memory-mb": str(figures["peak_memory_mb"])} if figures["peak_memory_mb"] is not None else {}),
        }  # fmt: skip
        return Response(output.files[0], media_type="video/mp4", headers=headers)


def _add_image_routes(app: FastAPI, service: GenerationService) -> None:
    """The image endpoints, and the route of the files they answer as URLs (response_format 'url')."""
    kept_outputs = KeptOutputs()  # the newest such files, in memory

    @app.post("/v1/images/generations", response_model=ImageGenerationResponse, responses=_GENERATION_ERRORS,
              openapi_extra=json_request_body(ImageGenerationRequest))  # fmt: skip
    async def create_images(request: Request) -> JSONResponse:
        body, output = await _run_generation(service, request, ImageGenerationRequest, "image")
        return _ok(await _image_response(request, body, output, kept_outputs))

    @app.post("/v1/images/edits", response_model=ImageGenerationResponse, responses=_IMAGE_INPUT_GENERATION_ERRORS,
              openapi_extra=edit_request_body())  # fmt: skip
    async def create_edits(request: Request) -> JSONResponse:
        body, output = await _run_edit(service, request)
        return _ok(await _image_response(request, body, output, kept_outputs))

    images = binary_response("The image", "image/png", "image/jpeg", "image/webp")

    @app.get("/v1/images/outputs/{name}", name="image_output", response_class=Response,
             responses={**images, **_IMAGE_OUTPUT_ERRORS})  # fmt: skip
    async def image_output(name: str) -> Response:
        kept = kept_outputs.get(name)
        if kept is None:
            message = (
                f"no image output {name!r}: response_format 'url' outputs are kept in memory, the newest"
                f" {kept_outputs.max_outputs} (at most {format_bytes(kept_outputs.max_bytes)}),"
                " until the server restarts"
            )
            raise ApiError(404, message, code="not_found", param="name")
        return Response(kept.data, media_type=kept.media_type)


def _served_methods(app: FastAPI, scope: Scope) -> set[str]:
    """Every method of all routes on the path Starlette chose for a 405 (the first route whose path matches)."""
    routes = [route for route in app.router.routes if isinstance(route, Route) and route.methods]
    chosen = next((route for route in routes if route.matches(scope)[0] is not Match.NONE), None)
    if chosen is None:
        return set()
    return set().union(*(route.methods or () for route in routes if route.path == chosen.path))


def _lifespan(service: GenerationService, jobs: JobManager | None):
    """Start the service's worker; on shutdown drain and stop it, then close the job history."""

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        service.start()
        yield
        # by now uvicorn has answered every open request; joining off the loop keeps it responsive anyway
        await asyncio.to_thread(service.stop)
        if jobs is not None:
            await asyncio.to_thread(jobs.close)

    return lifespan


async def _run_generation(
    service: GenerationService, request: Request, model: type[GenerationBody], kind: str
) -> tuple[Any, GenerationOutput]:
    """Parse, check, queue and await one generation request: (its body, its output), or an `ApiError`."""
    service.check_endpoint(kind)  # the wrong endpoint is the first thing to say, whatever the body holds
    body = await _read_body(request, service.body_limit(kind), _limit_flags(service, kind))
    try:
        parsed = await asyncio.to_thread(model.model_validate_json, json_body(body))  # up to ~43 MB: off the event loop
    except ValidationError as e:
        raise validation_error(e, model) from None
    image_b64 = getattr(parsed, "image", None)
    service.check_image_presence(has_image=image_b64 is not None, endpoint=request.url.path)
    image = await asyncio.to_thread(lambda: service.read_image(decode_base64_image(image_b64))) if image_b64 else None
    return parsed, await _submit_and_wait(service, request, service.prepare(parsed, image))


async def _run_edit(service: GenerationService, request: Request) -> tuple[ImageEditRequest, GenerationOutput]:
    """`POST /v1/images/edits`: the multipart form and its image, then as a generation: (the fields, the output)."""
    service.check_endpoint("edit")
    content_type = request.headers.get("content-type", "")
    if content_type.lower().startswith("application/x-www-form-urlencoded"):  # a form, but it cannot hold a file
        message = "image is required: send a multipart/form-data body with the image as a file part named image"
        raise ApiError(400, message, code="invalid_image", param="image")
    if not content_type.lower().startswith("multipart/form-data"):
        raise ApiError(
            400, f"expected a multipart/form-data body (an image file part and form fields), got {content_type or 'none'!r}",
            code="invalid_body", param="body",
        )  # fmt: skip
    body = await _read_body(request, service.body_limit("edit"), _limit_flags(service, "edit"))
    model = service.limits.model
    fields, image_bytes = await read_form(request, body, "image", model=model, refused=edit_refusals(model))
    if image_bytes is None:
        raise ApiError(400, "image is required: a file part named image", code="invalid_image", param="image")
    try:
        parsed = ImageEditRequest.model_validate(fields)
    except ValidationError as e:
        raise validation_error(e, ImageEditRequest) from None
    image = await asyncio.to_thread(service.read_image, image_bytes)
    return parsed, await _submit_and_wait(service, request, service.prepare(parsed, image))


async def _image_response(
    request: Request, body: ImageGenerationRequest, output: GenerationOutput, kept_outputs: KeptOutputs
) -> ImageGenerationResponse:
    """The answer to an image request: its files in `output_format`, inline or as URLs to `kept_outputs`."""
    if body.user is not None or body.quality is not None:  # recorded here only: they change nothing
        logger.info("image request: user %r, quality %r", body.user, body.quality)
    # the files come encoded in the body's format (the worker encoded each once): base64 only here, at the edge
    if body.response_format == "url":
        names = [kept_outputs.put(f, body.output_format) for f in output.files]
        data = [ImageData(url=str(request.url_for("image_output", name=name))) for name in names]
    else:
        data = [ImageData(b64_json=_base64(f)) for f in output.files]
    usage = output.usage
    return ImageGenerationResponse(
        created=int(time.time()), data=data, output_format=body.output_format, size=f"{usage.width}x{usage.height}",
        layerstream=usage,
    )


def _base64(data: bytes) -> str:
    return base64.b64encode(data).decode("ascii")


async def _submit_and_wait(service: GenerationService, request: Request, served: ServedRequest) -> GenerationOutput:
    try:
        job = service.submit(served)
    except QueueFullError as e:
        raise ApiError(429, f"{e}; retry later", code="queue_full", headers={"Retry-After": "1"}) from None
    except QueueClosedError as e:
        raise ApiError(503, str(e), code="shutting_down") from None
    return await _await_job(service, job, request)


async def _await_job(service: GenerationService, job: Job, request: Request) -> GenerationOutput:
    """The job's output, or its failure as an `ApiError`. A passed deadline or a disconnect answers at once and
    drops the job if it has not started, else asks the worker to stop it at its next step."""
    result = asyncio.wrap_future(job.future)
    client_gone = asyncio.ensure_future(_wait_for_disconnect(request))
    try:
        await asyncio.wait({result, client_gone}, timeout=job.seconds_left(), return_when=asyncio.FIRST_COMPLETED)
        if not result.done():
            reason = StopReason.CLIENT_GONE if client_gone.done() else StopReason.TIMEOUT
            raise _stopped_answer(reason, job, started=not service.queue.stop(job, reason))
        return result.result()
    except ApiError:
        raise
    except GenerationStopped as e:  # a shutdown stopped it: the other reasons are answered above, not awaited
        raise _stopped_answer(e.reason, job, started=True) from None
    except QueueTimeoutError as e:
        raise ApiError(504, f"the request {e}", code="queue_timeout", param="timeout") from None
    except QueueClosedError as e:
        raise ApiError(503, str(e), code="shutting_down") from None
    except GenerationError as e:
        raise ApiError(400, str(e), code="invalid_for_model") from None
    except Exception as e:  # the worker logged the traceback; the client gets one line
        message = f"generation failed: {client_line(e)}"
        raise ApiError(500, message, code="generation_failed") from None
    finally:
        client_gone.cancel()
        if not job.future.done():
            # leaving before the outcome: asked above, or this task was cancelled (the graceful shutdown ran
            # out); either way nobody will read it. A stop already asked for keeps its first reason.
            service.queue.stop(job, StopReason.CLIENT_GONE)
        # nobody reads the outcome of an abandoned job; cancelling the wrapper keeps asyncio from logging it
        result.cancel()


def _stopped_answer(reason: StopReason, job: Job, *, started: bool) -> ApiError:
    """The answer to a request whose job was dropped (`started` False) or stopped between steps."""
    if reason is StopReason.CLIENT_GONE:
        when = "during its generation, which was stopped" if started else "before its generation started"
        return ApiError(499, f"the client closed the connection {when}", code="client_gone")
    if reason is StopReason.SHUTDOWN:
        return ApiError(503, "the server is shutting down; the generation was stopped", code="shutting_down")
    if not started:
        message = f"the request waited {job.queue_seconds:.3f} s in the queue (timeout {job.timeout} s); not started"
        return ApiError(504, message, code="queue_timeout", param="timeout")
    message = f"the request ran past its timeout of {job.timeout} s; its generation was stopped"
    return ApiError(504, message, code="generation_timeout", param="timeout")


async def _wait_for_disconnect(request: Request) -> None:
    """Return when the client disconnects (the body has been read, so only that message can come)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


class RequestMetricsMiddleware:
    """Counts every answer by endpoint and status, with its latency (plain ASGI: it never touches the body)."""

    def __init__(self, app: ASGIApp, *, metrics: ServerMetrics):
        self.app, self.metrics = app, metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = time.perf_counter()
        status = 500  # if the app fails before answering, that is what the client sees

        async def send_and_record_status(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, send_and_record_status)
        finally:
            # the matched route's template (/v1/videos/{video_id}), never the path a client sent: bounded labels
            route = scope.get("route")
            endpoint = getattr(route, "path", None) or "other"
            self.metrics.observe_request(endpoint, status, time.perf_counter() - started)


def _limit_flags(service: GenerationService, endpoint_kind: str) -> str:
    """The flags that set an endpoint's body limit, to name in a 413."""
    if service.body_limit(endpoint_kind) == service.settings.max_body_bytes:
        return "--max-body-bytes"
    return "--max-body-bytes plus --max-image-bytes as base64"


def _ok(response: BaseModel) -> JSONResponse:
    return JSONResponse(response.model_dump())
