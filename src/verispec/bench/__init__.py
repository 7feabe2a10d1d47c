"""`verispec bench`: measure every method (ours and peer systems) on the same prompts and model.

One module per responsibility:
- `datasets`: prompt sets (Spec-Bench JSONL, the built-in set shipped in `data/`), resolution of
  `spec-bench`, category selection, prompt formatting.
- `peers`: peer systems run through transformers' own `generate()` on the same loaded model.
- `energy`: energy meters (Intel RAPL, NVIDIA NVML) where the machine exposes one.
- `runner`: the measurement loop, the append-only records file, the run config and resume.
- `metrics`: pure functions, records -> summaries (speedup, acceptance, exact match, ...).
- `report`: the terminal table, `summary.json`, `report.md` and the plots.

The CLI command `verispec bench` (in `verispec.cli`) is a thin shell over `runner.run_bench`.
"""
