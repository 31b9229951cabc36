"""Reading request bodies within their limits: the whole body (413 once over), and multipart forms."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Mapping

from starlette.requests import ClientDisconnect, Request

from layerstream.server.connections import BODY_PACE, BodyPace
from layerstream.server.errors import ApiError

logger = logging.getLogger(__name__)

# An oversized body is read and dropped up to this many bytes before answering 413, so that the client,
# still sending, reads the answer instead of a reset connection; beyond it the connection is just closed.
DRAIN_LIMIT_BYTES = 64 << 20
MAX_FORM_FIELDS = 32  # fields, and files, of a form: what OpenAI's endpoints take, and ours


async def read_body(
    request: Request, max_bytes: int, limit_flags: str = "--max-body-bytes", pace: BodyPace | None = None
) -> bytes:
    """The request body, or a 413 naming the limit once it is known to exceed `max_bytes`, or a 408 once it falls
    behind `pace` (default `BODY_PACE`; the connection closes just after: `connections.guarded_h11`)."""
    pace = pace or BODY_PACE
    message = f"the request body is larger than the server's limit of {max_bytes} bytes ({limit_flags})"
    too_large = ApiError(413, message, code="body_too_large", param="body")
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > DRAIN_LIMIT_BYTES:
        raise too_large
    chunks: list[bytes] = []
    size = 0
    loop, stream = asyncio.get_running_loop(), request.stream().__aiter__()
    started = loop.time()
    try:
        while True:
            try:
                chunk = await asyncio.wait_for(anext(stream), max(pace.deadline(started, size) - loop.time(), 0.0))
            except StopAsyncIteration:
                break
            except asyncio.TimeoutError:
                elapsed = loop.time() - started
                message = f"the request body came too slowly: {size} bytes in {elapsed:.1f} s (a body has "
                message += f"{pace.timeout_s:g} s, and 1 s more for every {pace.min_rate:g} bytes received)"
                raise ApiError(408, message, code="body_timeout", param="body") from None
            size += len(chunk)
            if size <= max_bytes:
                chunks.append(chunk)
            elif size > DRAIN_LIMIT_BYTES:
                break
    except ClientDisconnect:
        # an ordinary event for a server (a client killed, a network dropped): one line, and counted as 499
        path = request.url.path
        logger.info("%s %s: the client disconnected after sending %d bytes of its body", request.method, path, size)
        raise ApiError(499, "the client closed the connection while sending its body", code="client_gone") from None
    if size > max_bytes:
        raise too_large
    return b"".join(chunks)


def json_body(body: bytes) -> bytes:
    """A JSON body as the parser takes it: a UTF-8 byte order mark dropped (RFC 8259 lets a parser ignore one, and
    Windows tools write one), UTF-16 and UTF-32 refused in one line (JSON between systems is UTF-8)."""
    if 0 in body[:4]:  # UTF-16 and UTF-32 put a NUL byte in the first four (JSON text in UTF-8 has none)
        message = "the JSON body is not UTF-8 (it looks like UTF-16 or UTF-32): send it encoded as UTF-8"
        raise ApiError(400, message, code="invalid_body", param="body")
    return body.removeprefix(b"\xef\xbb\xbf")


def read_urlencoded(body: bytes, image_field: str) -> tuple[dict[str, str], None]:
    """(the text fields, None) of a url-encoded body (aiohttp's form), checked as `read_form` checks its own."""
    from urllib.parse import parse_qsl

    try:
        pairs = parse_qsl(body.decode("utf-8"), keep_blank_values=True, strict_parsing=bool(body), max_num_fields=MAX_FORM_FIELDS)
    except (UnicodeDecodeError, ValueError) as e:
        raise ApiError(400, f"the url-encoded body cannot be parsed: {e}", code="invalid_body", param="body") from None
    fields: dict[str, str] = {}
    for name, value in pairs:
        if name in (image_field, image_field + "[]"):
            message = f"{name} must be a file part of a multipart/form-data body (or base64 in a JSON body), not url-encoded text"
            raise ApiError(422, message, code="invalid_image", param=image_field)
        if name in fields:
            raise ApiError(422, f"{name} is given more than once; expected one", code="invalid_request", param=name)
        fields[name] = value
    return fields, None


async def read_form(
    request: Request, body: bytes, image_field: str, *, model: str, refused: Mapping[str, str] | None = None
) -> tuple[dict[str, str], bytes | None]:
    """(the text fields, the image file part's bytes or None) of a multipart `body`; a 4xx naming the part at
    fault. Parsed in a worker thread on a loop of its own (up to ~43 MB): Starlette's parser is a coroutine."""
    def parse() -> tuple[dict[str, str], bytes | None]:  # the coroutine made on the thread: a cancelled wait leaves none
        return asyncio.run(_parse_form(request.headers, body, image_field, model=model, refused=refused))

    return await asyncio.to_thread(parse)


async def _parse_form(
    headers: Mapping[str, str], body: bytes, image_field: str, *, model: str, refused: Mapping[str, str] | None
) -> tuple[dict[str, str], bytes | None]:
    """`read_form`'s parse: the image as `image_field` or, as OpenAI's client sends it, a list of one."""
    from starlette.datastructures import UploadFile
    from starlette.formparsers import MultiPartException, MultiPartParser

    async def read_body_again() -> AsyncIterator[bytes]:  # it was read (and bounded) already
        yield body

    parser = MultiPartParser(
        # files beyond the image are parsed to be refused by name (a mask, a second image), not as "too many"
        headers, read_body_again(), max_files=MAX_FORM_FIELDS, max_fields=MAX_FORM_FIELDS,
        max_part_size=len(body) + 1,
    )  # fmt: skip
    try:
        form = await parser.parse()
    except MultiPartException as e:
        raise ApiError(400, f"the multipart body cannot be parsed: {e.message}", code="invalid_body", param="body") from None
    try:
        fields: dict[str, str] = {}
        images: list[UploadFile] = []
        for name, value in form.multi_items():
            if name in (image_field, image_field + "[]"):
                if not isinstance(value, UploadFile):
                    message = f"{name} must be a file part (the image file), not a text field"
                    raise ApiError(422, message, code="invalid_image", param=image_field)
                images.append(value)
            elif refused and name in refused:
                raise ApiError(422, refused[name], code="invalid_request", param=name)
            elif name in fields:
                raise ApiError(422, f"{name} is given more than once; expected one", code="invalid_request", param=name)
            elif isinstance(value, UploadFile):
                message = f"{name} is a file part; only {image_field} may be a file"
                raise ApiError(422, message, code="invalid_request", param=name)
            else:
                fields[name] = value
        if len(images) > 1:
            message = f"{image_field}: got {len(images)} images; {model} takes one input image"
            raise ApiError(422, message, code="invalid_image", param=image_field)
        return fields, (await images[0].read() if images else None)
    finally:
        await form.close()


def edit_refusals(model: str) -> dict[str, str]:
    return {"mask": f"mask is not supported: {model} edits the whole image as the prompt says; send no mask"}


def decode_base64_image(text: str, field: str = "image") -> bytes:
    """The bytes of a base64 image field, plain or as a data URL, line breaks allowed; 400 naming `field` if it
    is neither. An image type or ``application/octet-stream`` is read by its bytes; another type is a 415."""
    import base64
    import binascii

    if text.startswith("data:"):
        header, _, text = text.partition(",")
        media_type, *parameters = header[len("data:") :].split(";")
        if parameters[-1:] != ["base64"]:
            raise ApiError(400, f"{field} is a data URL that is not base64-encoded", code="invalid_image", param=field)
        media_type = media_type.strip().lower()
        if not (media_type.startswith("image/") or media_type == "application/octet-stream"):
            message = (
                f"{field} is a data URL of type {media_type or 'text/plain (none given)'!r}; expected an image type"
                f" (image/png, image/jpeg, image/webp) or application/octet-stream, holding a PNG, JPEG or WebP file"
            )
            raise ApiError(415, message, code="unsupported_image_format", param=field)
    try:
        return base64.b64decode("".join(text.split()), validate=True)  # without the line breaks `base64` prints
    except (binascii.Error, ValueError):
        raise ApiError(400, f"{field} is not valid base64", code="invalid_image", param=field) from None
