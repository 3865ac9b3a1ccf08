"""Spans and logs as library code emits them (opentelemetry-api, structlog). The SDK that exports
them is set up by the runtime (`miles.runtime.tracing`)."""
