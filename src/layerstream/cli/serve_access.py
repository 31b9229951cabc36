"""``serve``'s access flags: which Hosts and Origins it answers, its API key and the model's served names."""

from __future__ import annotations

import argparse
import os

from layerstream.cli.common import CliError
from layerstream.server.access import API_KEY_ENV, AccessSettings, AccessSettingsError  # plain data: no serve extra


def flag_error(error: Exception, flags: dict[str, str]) -> CliError:
    """`error` as a `CliError` naming the flag the user typed instead of the settings field it starts with."""
    message = str(error)
    field = next((field for field in flags if message.startswith(field + " ")), None)
    return CliError(message if field is None else flags[field] + message[len(field) :])


def add_access_arguments(parser: argparse.ArgumentParser) -> None:
    for flag, nargs, default, metavar, help_text in (
        ("--allowed-hosts", "+", None, "HOST", "Host names a request may name besides loopback ones (a guard against "
         "DNS rebinding): names, .domain for a domain and its names, IP addresses or networks, or '*' for any. "
         "Default: none bound to loopback; bound to another address, this machine's names and any IP address"),
        ("--allowed-origins", "+", (), "ORIGIN", "origins (https://app.example) whose pages may send POST and DELETE "
         "here and read answers (CORS), or '*'. Default: none but the server's own page"),
        ("--api-key", None, None, "KEY", "require Authorization: Bearer KEY on every route but /health, /metrics and "
         f"the web page (default: the {API_KEY_ENV} environment variable, which ps does not show; unset: no key)"),
        ("--served-model-name", "+", (), "NAME", "the names a request's model may give; the first is the one answers "
         "and GET /v1/models name (default: the model as given, a folder by its own name)"),
    ):  # fmt: skip
        parser.add_argument(flag, nargs=nargs, default=default, metavar=metavar, help=help_text)


def access_settings(args: argparse.Namespace, bind_host: str) -> AccessSettings:
    """The access settings of the flags (and of the environment's key), checked before anything loads."""
    api_key = args.api_key if args.api_key is not None else os.environ.get(API_KEY_ENV) or None
    flags = {"allowed_hosts": "--allowed-hosts", "allowed_origins": "--allowed-origins",
             "api_key": f"--api-key (or {API_KEY_ENV})"}  # fmt: skip
    try:
        return AccessSettings(
            bind_host=bind_host, allowed_hosts=_split(args.allowed_hosts) if args.allowed_hosts is not None else None,
            allowed_origins=_split(args.allowed_origins), api_key=api_key,
        )  # fmt: skip
    except AccessSettingsError as e:
        raise flag_error(e, flags) from e


def _split(values) -> tuple[str, ...]:
    """Each value, and each comma-separated part of one (``a.example,b.example``, as Ollama's lists are written)."""
    return tuple(part.strip() for value in values for part in value.split(",") if part.strip())
