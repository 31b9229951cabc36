"""The in-code tokenizers: the calls the pipelines make work, listed words are single tokens, save/reload is exact."""

from __future__ import annotations

import pytest

from layerstream.models.tokenizers import (
    PROMPT_WORDS,
    QWEN_BARE_WORDS,
    build_clip_tokenizer,
    build_qwen2_tokenizer,
    build_t5_tokenizer,
)

# a unit or contract test: in `make test-fast` (no process, no socket; tests/conftest.py checks)
pytestmark = pytest.mark.fast

BUILDERS = {"t5": build_t5_tokenizer, "clip": build_clip_tokenizer, "qwen2": build_qwen2_tokenizer}


@pytest.mark.parametrize("kind", BUILDERS)
def test_listed_words_are_single_tokens(kind):
    tokenizer = BUILDERS[kind]()
    words = {word.lower() for word in PROMPT_WORDS} if kind == "clip" else set(PROMPT_WORDS)
    split = {word: tokenizer.tokenize(" " + word) for word in sorted(words)}
    assert {word: tokens for word, tokens in split.items() if len(tokens) != 1} == {}


def test_qwen_line_start_words_are_single_tokens():
    tokenizer = build_qwen2_tokenizer()
    assert {word: tokenizer.tokenize(word) for word in QWEN_BARE_WORDS} == {word: [word] for word in QWEN_BARE_WORDS}


@pytest.mark.parametrize("kind", BUILDERS)
def test_unknown_words_are_spelled_out_and_reload_identically(kind, tmp_path):
    tokenizer = BUILDERS[kind]()
    prompt = ["a zebra-striped Xylophone, 42 times!", "cat"]
    ids = tokenizer(prompt, padding="max_length", max_length=64, truncation=True, return_attention_mask=True)
    assert all(len(row) == 64 for row in ids.input_ids)
    assert sum(ids.attention_mask[1]) < sum(ids.attention_mask[0]) < 64  # padded, not truncated
    assert tokenizer.unk_token_id not in tokenizer(prompt[0], add_special_tokens=False).input_ids

    tokenizer.save_pretrained(tmp_path)
    reloaded = type(tokenizer).from_pretrained(tmp_path)
    assert reloaded(prompt, padding="longest").input_ids == tokenizer(prompt, padding="longest").input_ids
    assert len(reloaded) == len(tokenizer)


def test_t5_appends_end_of_sequence_and_pads_with_zero():
    tokenizer = build_t5_tokenizer()
    ids = tokenizer("a red cat", padding="max_length", max_length=8, return_attention_mask=True)
    assert ids.input_ids == [*tokenizer.convert_tokens_to_ids(["▁a", "▁red", "▁cat", "</s>"]), 0, 0, 0, 0]
    assert ids.attention_mask == [1, 1, 1, 1, 0, 0, 0, 0]


def test_clip_wraps_prompt_in_start_and_end_of_text():
    tokenizer = build_clip_tokenizer()
    tokens = tokenizer.convert_ids_to_tokens(tokenizer("A red cat").input_ids)
    assert tokens == ["<|startoftext|>", "a</w>", "red</w>", "cat</w>", "<|endoftext|>"]
    assert tokenizer.model_max_length == 77


def test_vocabularies_are_deterministic():
    for build in BUILDERS.values():
        assert build().get_vocab() == build().get_vocab()
