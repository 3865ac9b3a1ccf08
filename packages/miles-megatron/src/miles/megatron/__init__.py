"""Miles on Megatron-core: Hugging Face <-> Megatron weight mapping and model construction.

Importing this package needs no CUDA and no megatron-core (`convert`, `layout` and `names` are
torch functions); `miles.megatron.model` imports megatron-core.
"""
