"""One request's life in the text layer: a validated `Request`, its `Generation` (decode config,
stats, recipe; tokens to final text with stop strings) and `GenerationResult` (`lifecycle`), and
text in and out: prompt encoding, incremental detokenization, stop strings (`text`).
"""
