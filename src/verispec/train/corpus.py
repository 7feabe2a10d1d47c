"""The exit-head training corpus: project-written prompts, continued by the target itself.

Owns the prompt list (`data/prompts.jsonl`, written for this project: instructions, questions and
passages across writing, code, math, summarisation, question answering, translation and chat,
kept apart from every benchmark prompt so that training never sees evaluation text), the
generation of the corpus (the target samples continuations of the prompts, formatted like the
benchmark formats them; batched `generate()` because this is offline data making, not
decoding), and reading/writing the corpus file (JSONL, one document a line:
{"prompt": ..., "text": prompt + continuation}).

The corpus generated for the embedded default model ships as `data/corpus.jsonl`; regenerate it
with `verispec train-exit --generate-corpus`.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Iterator

import torch

from ..errors import ConfigError
from ..text import PLAIN_TEMPLATE

DATA = Path(__file__).parent / "data"
PROMPTS_PATH = DATA / "prompts.jsonl"
CORPUS_PATH = DATA / "corpus.jsonl"


def read_prompts(path: Path = PROMPTS_PATH) -> list[str]:
    prompts = []
    for number, line in enumerate(path.read_text().splitlines(), start=1):
        if not line.strip():
            continue
        try:
            prompts.append(json.loads(line)["prompt"])
        except (ValueError, KeyError, TypeError) as error:
            raise ConfigError(f"{path}:{number}: not a prompt record ({error})") from error
    return prompts


def read_corpus(path: Path = CORPUS_PATH) -> list[str]:
    """The documents of a corpus file: JSONL with a "text" field, or plain text (one
    document per blank-line-separated block)."""
    if not path.is_file():
        raise ConfigError(f"corpus file not found: {path}")
    raw = path.read_text()
    if path.suffix == ".jsonl":
        documents = []
        for number, line in enumerate(raw.splitlines(), start=1):
            if line.strip():
                try:
                    documents.append(json.loads(line)["text"])
                except (ValueError, KeyError, TypeError) as error:
                    raise ConfigError(f"{path}:{number}: not a corpus record ({error})") from error
        return documents
    return [block.strip() for block in raw.split("\n\n") if block.strip()]


def generate_corpus(target, prompts: list[str], new_tokens: int, out: Path, *, batch: int = 8,
                    temperature: float = 0.8, top_p: float = 0.95, seed: int = 0,
                    progress=None) -> Path:
    """Continue every prompt with the target (sampling) and write the corpus JSONL."""
    tokenizer = target.tokenizer
    torch.manual_seed(seed)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    out.parent.mkdir(parents=True, exist_ok=True)
    with out.open("w") as sink:
        for begin in range(0, len(prompts), batch):
            chunk = prompts[begin : begin + batch]
            texts = [PLAIN_TEMPLATE.format(prompt=p) for p in chunk]
            encoded = [tokenizer(t)["input_ids"] for t in texts]
            width = max(len(e) for e in encoded)
            ids = torch.tensor([[pad] * (width - len(e)) + e for e in encoded])  # left padding
            mask = torch.tensor([[0] * (width - len(e)) + [1] * len(e) for e in encoded])
            with torch.inference_mode():
                generated = target.model.generate(
                    input_ids=ids, attention_mask=mask, do_sample=True, temperature=temperature,
                    top_p=top_p, max_new_tokens=new_tokens, pad_token_id=pad,
                )
            for text, row in zip(texts, generated[:, width:]):
                continuation = tokenizer.decode(row, skip_special_tokens=True)
                sink.write(json.dumps({"prompt": text, "text": text + continuation}) + "\n")
            sink.flush()
            if progress is not None:
                progress(len(chunk))
    return out


def token_sequences(tokenizer, documents: list[str], length: int) -> Iterator[list[int]]:
    """Each document's ids (with BOS), split into pieces of at most `length` tokens (pieces
    shorter than 16 tokens are dropped)."""
    for document in documents:
        ids = tokenizer(document)["input_ids"]
        for begin in range(0, len(ids), length):
            piece = ids[begin : begin + length]
            if len(piece) >= 16:
                yield piece
