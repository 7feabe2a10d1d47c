"""The GGUF file format: a fast reader (`reader`), what a file says about its model (`metadata`:
config, tokenizer, chat template), exact int8 block forms of its quantized weights (`blocks`),
and a small writer (`writer`, for synthetic files). Knows nothing of how a model runs; the
runtime that runs a file's own blocks is `runtime.gguf_decoder`.
"""
