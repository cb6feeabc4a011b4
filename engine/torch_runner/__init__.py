"""The torch model runner: Llama- and Qwen2-family decoders over a paged KV cache.

Importing this package does not import torch; `runner`, `model`, `attention`, `loader` and
`sampler` do, so callers import them only when a torch model is actually served.
"""
