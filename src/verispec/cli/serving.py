"""`verispec serve`: the OpenAI-compatible server, its settings checked before the model loads
and its port bound before that (a busy port fails at once)."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer

from ..errors import VerispecError
from .shell import app, err, fail
from .target_options import EXIT_HEAD_OPTION, NGRAM_MEMORY_OPTION, TargetOptions, target_options


@app.command()
@target_options()
def serve(
    method: str = typer.Option("anpd", "--method", "-m", help="Default decoding method, with settings as in `bench --methods` (e.g. anpd/tree=8); a request may choose another with the `method` field."),
    host: str = typer.Option("127.0.0.1", help="Address to listen on (0.0.0.0 exposes the server to the network)."),
    port: int = typer.Option(8000, help="TCP port (0 = any free port)."),
    api_key: Optional[str] = typer.Option(None, "--api-key", envvar="VERISPEC_API_KEY", show_envvar=True,
                                          help="Require 'Authorization: Bearer KEY' (except on /health)."),
    max_queue: int = typer.Option(64, "--max-queue", help="Requests that may wait for the worker; more get 429."),
    request_timeout: float = typer.Option(300.0, "--request-timeout", help="Seconds a request may take from arrival, queue wait included (0 = no limit)."),
    max_tokens_limit: int = typer.Option(1024, "--max-tokens-limit", help="Largest max_tokens a request may ask for (also the default)."),
    model_id: Optional[str] = typer.Option(None, "--model-id", help="Model id clients send (default: verispec-default, or the model path's basename)."),
    ngram_memory: bool = NGRAM_MEMORY_OPTION,
    max_batch: int = typer.Option(16, "--max-batch", help="Requests decoded together (each choice of n counts); more wait in the queue."),
    max_rows: int = typer.Option(256, "--max-rows", help="Rows of one step's forward: the running requests' verify rows, then prompt chunks."),
    kv_memory: Optional[str] = typer.Option(None, "--kv-memory", help="KV memory of the batch, e.g. 2GiB (default: a quarter of the available memory, at most 2 GiB)."),
    prefix_cache: bool = typer.Option(True, "--prefix-cache/--no-prefix-cache", help="Keep computed prompt blocks for later requests that start with them (outputs are identical either way)."),
    draft_model: Optional[str] = typer.Option(None, "--draft-model", help="Draft model of sps and mtad requests (same tokenizer; default: the EESD exit head)."),
    exit_head: Optional[str] = EXIT_HEAD_OPTION,
    max_body: str = typer.Option("4MiB", "--max-body", help="Largest request body (e.g. 4MiB, 500000); a larger one gets 413 before it is read."),
    max_prompt_chars: int = typer.Option(1_000_000, "--max-prompt-chars", help="Most characters of a prompt (or of a chat's messages), checked before tokenizing; more get 400."),
    max_connections: int = typer.Option(1000, "--max-connections", help="Connections open at once; one more gets 503 and is closed."),
    header_timeout: float = typer.Option(10.0, "--header-timeout", help="Seconds a connection may take to send a request's headers (0 = no limit)."),
    body_timeout: float = typer.Option(60.0, "--body-timeout", help="Seconds a request may take to send its body once the headers are in; 408 after (0 = no limit)."),
    target: TargetOptions = None,
) -> None:
    """Serve the model over an OpenAI-compatible HTTP API: requests are decoded together in a continuous batch."""
    options = dict(locals())  # every argument, by name
    from ..runtime.kv_pool import parse_bytes
    from ..server import create_app
    from ..server.connections import uvicorn_config

    try:
        # Everything that needs no model is checked before the model is loaded.
        settings = _server_settings(options)
        kv_bytes = None if kv_memory is None else parse_bytes(kv_memory)
        sock = listen(host, port)
        model = _ready_target(target, settings, kv_bytes, prefix_cache, ngram_memory)
    except VerispecError as error:
        fail(str(error))
        return
    import uvicorn

    bound_host, bound_port = sock.getsockname()[:2]
    shown_host = f"[{bound_host}]" if ":" in bound_host else bound_host
    url = f"http://{shown_host}:{bound_port}/v1"
    batching = (f"up to {max_batch} requests together, KV {model.pool.blocks * model.pool.block_bytes / 2**30:.2f} GiB, "
                f"prefix cache {'on' if prefix_cache else 'off'}" if model.pages_kv
                else "one request at a time (no exact batching for this target: it needs the block kernel in int8 numerics)")
    err.print(f"serving {model.name} as '{settings.model_id}' ({str(model.dtype).replace('torch.', '')} on "
              f"{model.device}, method {method}; {batching}) at {url}", highlight=False, soft_wrap=True)
    print(url, flush=True)
    config = uvicorn_config(create_app(model, settings), settings, log_level="info", timeout_graceful_shutdown=5)
    uvicorn.Server(config).run(sockets=[sock])


def _server_settings(options: dict):
    """The checked `ServerSettings` of `serve`'s arguments (and the open-file limit raised for
    --max-connections)."""
    from ..request.text import checked_text
    from ..runtime.kv_pool import parse_bytes
    from ..server import ServerSettings, default_model_id
    from ..server.app import served_method
    from ..server.connections import ensure_file_limit
    from ..target.loading import resolve_dtype

    target: TargetOptions = options["target"]
    served_method(options["method"])
    target.check()
    for option, key in (("--api-key", "api_key"), ("--model-id", "model_id")):
        if options[key] is not None:
            checked_text(options[key], option)
    resolve_dtype(target.dtype)
    if not 0 <= options["port"] <= 65535:
        fail(f"--port must be in 0..65535, got {options['port']}")
    try:
        max_body_bytes = parse_bytes(options["max_body"])
    except VerispecError as error:
        fail(f"--max-body: {error}")
    settings = ServerSettings(
        model_id=options["model_id"] if options["model_id"] is not None else default_model_id(target.model),
        default_method=options["method"], max_sequences=options["max_batch"], max_body_bytes=max_body_bytes,
        **{key: options[key] for key in ("api_key", "max_queue", "request_timeout", "max_tokens_limit", "max_rows",
                                         "draft_model", "exit_head", "max_prompt_chars", "max_connections",
                                         "header_timeout", "body_timeout")})
    ensure_file_limit(options["max_connections"])
    for option, path in (("--draft-model", options["draft_model"]), ("--exit-head", options["exit_head"])):
        if path is not None and not Path(path).expanduser().exists():
            fail(f"{option}: {path} not found")
    return settings


def _ready_target(target: TargetOptions, settings, kv_bytes: int | None, prefix_cache: bool, ngram_memory: bool):
    """The loaded target with its KV pool, memory switch, draft model and exit head made now (a
    budget too small for one block, or a draft model that will not load, refused before serving)."""
    model = target.load()
    model.kv_memory, model.prefix_cache = kv_bytes, prefix_cache
    if model.pages_kv:
        model.pool  # noqa: B018 - made now: a budget too small for one block is refused before serving
    if not ngram_memory:  # for every request, whatever method it asks for
        from ..core.drafters.base import switch_off_memory

        switch_off_memory(model.attachments)
    if settings.draft_model is not None or settings.exit_head is not None:  # loaded now, not in the first request
        from ..core.methods import MethodOptions, draft_lm, prepared_exit_head

        if settings.draft_model is not None:
            draft_lm(model, MethodOptions(draft_model=settings.draft_model))
        if settings.exit_head is not None:
            prepared_exit_head(model, settings.exit_head)
    return model


def listen(host: str, port: int):
    """A listening TCP socket on (host, port), bound before the model loads so that a busy port
    fails at once."""
    import socket

    try:
        family, kind, proto, _, address = socket.getaddrinfo(
            host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)[0]
    except socket.gaierror as error:
        raise VerispecError(f"cannot resolve host {host!r}: {error.strerror}") from None
    sock = socket.socket(family, kind, proto)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind(address)
    except OSError as error:
        sock.close()
        raise VerispecError(f"cannot listen on {host}:{port}: {error.strerror or error}") from None
    sock.listen(2048)
    return sock
