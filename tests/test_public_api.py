"""The public surface, pinned by name: the library's exports, the CLI's commands and the HTTP
routes. A rename inside the package must not move any of them."""

from __future__ import annotations

import inspect

import verispec

LIBRARY = {"GenerationResult", "TextStream", "generate", "stream", "generate_many", "stream_many", "make_request",
           "ConfigError", "ModelLoadError", "VerispecError", "transformers_generate", "METHODS", "MethodOptions",
           "method_names", "Target", "load", "SamplingConfig", "GenerationStats"}
COMMANDS = {"generate", "bench", "bench-serve", "serve", "info", "profile", "train-exit"}
ROUTES = {("GET", "/v1/models"), ("GET", "/v1/models/{model_id:path}"), ("GET", "/health"), ("GET", "/metrics"),
          ("POST", "/v1/completions"), ("POST", "/v1/chat/completions")}


def test_the_library_exports_its_names_and_each_resolves():
    assert set(verispec.__all__) == LIBRARY
    for name in LIBRARY:
        assert getattr(verispec, name) is not None


def test_the_calls_users_make_keep_their_first_parameters():
    assert list(inspect.signature(verispec.generate).parameters)[:3] == ["target", "prompt", "method"]
    assert list(inspect.signature(verispec.load).parameters)[:1] == ["model"]
    assert "response_format" in inspect.signature(verispec.make_request).parameters  # generate's, stream's too


def test_the_command_line_has_its_commands():
    import typer.main

    from verispec.cli import app

    group = typer.main.get_command(app)
    assert set(group.commands) == COMMANDS


def test_every_command_of_the_entry_point_keeps_its_target_options():
    import typer.main

    from verispec.cli import app

    group = typer.main.get_command(app)
    options = {name: {opt for param in command.params for opt in getattr(param, "opts", [])}
               for name, command in group.commands.items()}
    for name in ("generate", "bench", "serve", "profile"):
        assert {"--model", "--dtype", "--fast", "--block-kernel", "--numerics", "--device", "--compile"} <= options[name]
    assert {"--model", "--device"} <= options["train-exit"]
    assert {"--json-schema", "--regex", "--grammar"} <= options["generate"]  # structured output


def test_the_server_has_its_routes(char_tokenizer):
    import server_helpers as sh
    from verispec.server import ServerSettings, create_app

    app = create_app(sh.text_target(char_tokenizer), ServerSettings())
    routes = {(method, route.path) for route in app.routes for method in getattr(route, "methods", ()) or ()
              if method != "HEAD"}
    assert ROUTES <= routes
