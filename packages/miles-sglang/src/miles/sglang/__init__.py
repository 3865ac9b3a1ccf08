"""SGLang in Miles: its wire protocol (`protocol`: the native endpoints' field lists from SGLang's
`io_struct.py`; `openai`, `openai_chunks`: the OpenAI-compatible API) and rollout backend `sglang`
(`engine`: a RolloutEngine over SGLang or `miles serve` servers, launched or attached)."""
