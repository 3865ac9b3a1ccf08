"""Low-precision number formats in plain torch: FP8 (128x128 blocks), MXFP8 and INT4.

Each module quantizes and dequantizes one format; `linear` turns them into training-time
replacements for `nn.Linear` that keep parameter names, so state dicts and HF names are unchanged.
Everything runs on CPU, which is what makes the formats testable without an accelerator.
"""
