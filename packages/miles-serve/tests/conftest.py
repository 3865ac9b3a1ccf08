"""`miles serve` as a real process on 127.0.0.1, driven over real HTTP (`miles.serve.fixtures`)."""

from miles.serve.fixtures import model, serve_process, serve_process_for_module, server

__all__ = ["model", "serve_process", "serve_process_for_module", "server"]
