"""The native CPU runtime: what makes a target forward fast and batch-invariant.

- `fastpath`: an own layer loop for the Llama family (Llama, Qwen2, Gemma 3) over a static KV
  cache, with prepacked linears (`linear`);
- `gguf.blocks`: exact int8 block forms of a GGUF model's weights (checked bit for bit at load);
- `blockmm` + `kernels/blockmm.c`, `kernels/blockmm_int8.c`: the block kernel, built per
  instruction set at first use and chosen at run time (numerics fp32 or int8);
- `native_layer` + `kernels/decoder_layer.c`: a decoder layer (or a forward's layers) in one C call.

`model.Target` is the only user; the algorithmic core (engine, acceptance, sampling, control,
drafters) knows nothing of it.
"""
