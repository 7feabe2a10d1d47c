"""The target model: where it comes from (`loading`), what it is (`model.Target`: identity, LM
head, KV memory, one backend), how its decoder runs (`backends`: transformers' forward, the
compiled CUDA step, the fast path, the C layers over paged KV), one request's state on it
(`sequence`), the forward shared by many sequences (`shared_forward`), a verify's logits computed
lazily (`lazy_logits`), transformers' caches and the PyTorch path (`hf_cache`, `torch_path`),
devices, and scoring text under it. Imports the runtime and the GGUF format, never the core.
"""
