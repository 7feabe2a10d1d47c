"""The OpenVINO GenAI peer's worker: a script run by OpenVINO's own Python (`make openvino`'s
environment, .peers/openvino), never imported by verispec. It loads one GGUF file with
`openvino_genai.LLMPipeline` (OpenVINO's own reading of the file's blocks) and answers requests
read from stdin, one JSON object a line, on stdout, one JSON object a line:

    argv: GGUF_PATH THREADS [--prompt-lookup]
    ready: {"ready": true, "load_s": seconds}  (or {"error": "..."} and exit 1)
    in:    {"ids": [prompt token ids], "max_new_tokens": N, "temperature": T, "top_k": K, "top_p": P,
            "seed": S}
    out:   {"tokens": [generated ids]}  or  {"error": "..."}

Greedy when T is 0. With --prompt-lookup the pipeline speculates from the prompt (OpenVINO's
prompt lookup: up to 10 tokens a draft from 3-grams). Only the standard library, numpy and
OpenVINO are imported here, so the script runs in an environment without verispec.
"""

import json
import sys
import time

PROMPT_LOOKUP_TOKENS = 10
PROMPT_LOOKUP_NGRAM = 3


def answer(message: dict) -> None:
    sys.stdout.write(json.dumps(message) + "\n")
    sys.stdout.flush()


def main() -> int:
    path, threads, lookup = sys.argv[1], int(sys.argv[2]), "--prompt-lookup" in sys.argv[3:]
    started = time.perf_counter()
    try:
        import numpy as np
        import openvino as ov
        import openvino_genai as genai

        options = {"INFERENCE_NUM_THREADS": threads}
        if lookup:
            options["prompt_lookup"] = True
        pipeline = genai.LLMPipeline(path, "CPU", **options)
    except Exception as error:  # reported to the parent, which raises it as the peer's failure
        answer({"error": f"{type(error).__name__}: {error}"})
        return 1
    answer({"ready": True, "load_s": time.perf_counter() - started})
    for line in sys.stdin:
        try:
            request = json.loads(line)
            config = pipeline.get_generation_config()
            config.max_new_tokens = int(request["max_new_tokens"])
            config.min_new_tokens = 0
            config.repetition_penalty = 1.0
            sampling = float(request.get("temperature", 0.0)) > 0
            config.do_sample = sampling
            if sampling:
                config.temperature = float(request["temperature"])
                config.top_k = int(request.get("top_k") or 0)
                config.top_p = float(request.get("top_p", 1.0))
                config.rng_seed = int(request.get("seed") or 0)
            if lookup:
                config.num_assistant_tokens = PROMPT_LOOKUP_TOKENS
                config.max_ngram_size = PROMPT_LOOKUP_NGRAM
            ids = np.array([request["ids"]], dtype=np.int64)  # [1, n]
            inputs = genai.TokenizedInputs(ov.Tensor(ids), ov.Tensor(np.ones_like(ids)))
            result = pipeline.generate(inputs, config)
            answer({"tokens": [int(t) for t in result.tokens[0]]})
        except Exception as error:
            answer({"error": f"{type(error).__name__}: {error}"})
    return 0


if __name__ == "__main__":
    sys.exit(main())
