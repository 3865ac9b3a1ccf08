"""The paged engine path: a KV cache allocated once in pages, a scheduler that admits and preempts
by free pages, packed prefill, paged decode attention and CUDA graphs (on GPU).

One idea per module, after nano-vllm's layout: `sequence` (a request's state), `pages` (the page
pool, reference counts and the prefix cache), `scheduler` (what runs next), `kv_cache` (the
tensors and their size), `attention` (prefill and decode attention over pages), `decode_kernel`
(the Triton paged-decode kernel), `model` (the fast forward of Llama-shaped families), `sampling`
(sync-free sampling), `graphs` (decode as CUDA graphs) and `runner` (one step of the engine).
"""
