"""`miles serve` processes on 127.0.0.1 (`miles.serve.fixtures`): what the sglang backend attaches to."""

from miles.serve.fixtures import model, serve_process, serve_process_for_module, server

__all__ = ["model", "serve_process", "serve_process_for_module", "server"]
