"""`TextCopy`: drafts from the prompt's text where the output writes it in other tokens, and ANPD
using it where its n-gram tables miss. A toy tokenizer (greedy longest match over a small
vocabulary) spells a word without its leading space in other tokens, as BPE vocabularies do."""

from __future__ import annotations

from verispec.core.drafters.ngram import AnpdDrafter, NgramConfig, text_kind
from verispec.core.drafters.text_copy import TextCopy

VOCAB = [" Sofia", " Marin", " is", " 34", " Text", ":", "S", "of", "ia", '"', ", ", ".", " ", "\n"] + \
    [chr(c) for c in range(ord("a"), ord("z") + 1)] + [chr(c) for c in range(ord("A"), ord("Z") + 1)] + \
    [str(d) for d in range(10)]
IDS = {piece: i for i, piece in enumerate(VOCAB)}


def encode(text: str) -> list[int]:
    ids, at = [], 0
    while at < len(text):
        piece = max((p for p in VOCAB if text.startswith(p, at)), key=len)
        ids.append(IDS[piece])
        at += len(piece)
    return ids


def decode(ids) -> str:
    return "".join(VOCAB[i] for i in ids)


PROMPT = encode(" Text: Sofia Marin is 34.\n")


def copier() -> TextCopy:
    copy = TextCopy(encode, decode)
    copy.begin(PROMPT)
    return copy


def test_the_toy_tokenizer_spells_a_word_otherwise_without_its_space():
    assert encode("Sofia Marin") == [IDS["S"], IDS["of"], IDS["ia"], IDS[" Marin"]]
    assert IDS[" Sofia"] in PROMPT


def test_a_word_quoted_without_its_space_is_copied_after_its_first_token():
    tokens, chars = copier().draft(encode('"S'), 4)
    assert decode(tokens) == "ofia Marin is" and chars == 1
    tokens, chars = copier().draft(encode('"Sof'), 8)
    assert decode(tokens).startswith("ia Marin is 34") and chars == 3


def test_no_draft_where_the_text_is_not_in_the_prompt_or_is_tokenized_otherwise():
    assert copier().draft(encode('"Q'), 4) == ([], 0)
    # "S" then "o": the prompt's text re-tokenized writes "S", "of": not these tokens
    assert copier().draft([IDS["S"], IDS["o"]], 4)[0] != encode("fia")
    assert copier().draft(encode('"S'), 0) == ([], 0)


def test_a_word_start_is_matched_at_a_word_start():
    copy = TextCopy(encode, decode)
    copy.begin(encode(" Sofia Marin is 34. Text: Xia"))
    # "ia" after a quote starts a word: the "ia" inside "Sofia" is not it, the last word "Xia" is
    # not either (it starts with X); nothing at a word start follows, so nothing is drafted
    assert copy.draft(encode('"ia'), 4) == ([], 0)
    assert decode(copy.draft(encode("Sofia")[:2], 4)[0]).startswith("ia Marin")  # mid-word: "S", "of" -> "ia"


def test_anpd_copies_text_where_its_tables_miss_and_learns_the_copies_apart():
    plain, copying = AnpdDrafter(NgramConfig()), AnpdDrafter(NgramConfig(), copier=copier())
    context = PROMPT + encode('"S')
    for drafter in (plain, copying):
        drafter.begin(PROMPT)
        drafter.commit(encode('"S'), 0)
    assert plain.propose(context, 4).tokens.tolist() == []
    draft = copying.propose(context, 4)
    assert decode(draft.tokens.tolist()) == "ofia Marin is"
    copying.commit(encode("ofia Marin") + [IDS['"']], 4)  # three accepted, the fourth rejected
    assert copying._outcomes[text_kind(1, 0)] == [1, 0] and copying._outcomes[text_kind(1, 3)] == [0, 1]
