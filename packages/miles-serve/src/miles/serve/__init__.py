"""`miles serve`: Miles' torch engine behind SGLang's native endpoints (`/generate`, weight updates,
...) and the OpenAI-compatible ones (`/v1/chat/completions`, `/v1/completions`, `/v1/responses`,
...). The wire it speaks is `miles.sglang.protocol` and `miles.sglang.openai`; see docs/serve.md."""
