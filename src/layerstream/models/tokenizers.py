"""Tokenizers for the embedded tiny models, built in code: the classes the real checkpoints ship, so a tiny model
folder reloads like a real one, with small vocabularies (printable ASCII, so any English prompt tokenizes, plus
whole-word tokens for common prompt words) built in a fixed order, so every machine gets the same token ids.
"""

from __future__ import annotations

import string
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from transformers import CLIPTokenizer, Qwen2Tokenizer, T5Tokenizer

# Whole-word tokens. Must contain every word of diffusers' Qwen-Image prompt template (see
# `build_qwen2_tokenizer`); the rest are common prompt words so that short prompts stay short.
PROMPT_WORDS = (
    "a", "an", "the", "of", "and", "in", "on", "with", "at", "by", "to", "from", "over", "under", "is", "are",
    "cat", "dog", "bird", "fish", "horse", "person", "man", "woman", "child", "robot", "car", "boat", "tree",
    "flower", "house", "city", "street", "mountain", "river", "sea", "beach", "forest", "sky", "sun", "moon",
    "star", "cloud", "rain", "snow", "fire", "water", "light", "night", "day", "morning", "sunset",
    "red", "green", "blue", "yellow", "white", "black", "orange", "purple", "golden", "dark", "bright",
    "small", "large", "big", "tiny", "old", "young", "happy", "beautiful", "cinematic", "detailed",
    "photo", "painting", "video", "image", "portrait", "landscape", "style", "walking", "running", "flying",
    "sitting", "dancing", "swimming", "playing", "low", "quality", "blurry", "ugly", "static",
    # Qwen-Image prompt template words.
    "system", "user", "assistant", "Describe", "detailing", "color", "shape", "size", "texture", "quantity",
    "text", "spatial", "relationships", "objects", "background",
)

# Characters every tokenizer can spell any prompt with. No whitespace: each tokenizer marks spaces its own way.
CHARACTERS = tuple(string.ascii_letters + string.digits + string.punctuation)


def _byte_level_alphabet() -> list[str]:
    """The 256 symbols byte-level BPE spells bytes with, sorted so that token ids are the same everywhere."""
    from tokenizers.pre_tokenizers import ByteLevel

    return sorted(ByteLevel.alphabet())


def _chain_merges(words: list[list[str]], *, right_to_left: bool) -> tuple[list[tuple[str, str]], list[str]]:
    """(BPE merges in rank order, the tokens they make) that assemble each word (its initial symbols) into one
    token. A chain grows from the end whose marker no other position has (GPT-2's leading ``Ġ``, CLIP's
    trailing ``</w>``), so no merge of one word can fire inside another and steal a symbol its chain needs."""
    merges: list[tuple[str, str]] = []
    new_tokens: list[str] = []
    seen: set[tuple[str, str]] = set()
    for symbols in words:
        token = symbols[-1] if right_to_left else symbols[0]
        for symbol in reversed(symbols[:-1]) if right_to_left else symbols[1:]:
            pair = (symbol, token) if right_to_left else (token, symbol)
            token = pair[0] + pair[1]
            if pair not in seen:
                seen.add(pair)
                merges.append(pair)
                new_tokens.append(token)
    return merges, new_tokens


def _index(tokens: list[str]) -> dict[str, int]:
    """Token -> id in first-seen order, dropping repeats."""
    vocab: dict[str, int] = {}
    for token in tokens:
        vocab.setdefault(token, len(vocab))
    return vocab


def build_t5_tokenizer(*, model_max_length: int = 512) -> T5Tokenizer:
    """A T5 (Unigram) tokenizer as UMT5 and T5 encoders use: ``<pad>`` = 0, ``</s>`` = 1, ``<unk>`` = 2; listed
    words score far better than their spelling, anything else falls back to characters."""
    from transformers import T5Tokenizer

    pieces = [("<pad>", 0.0), ("</s>", 0.0), ("<unk>", 0.0), ("▁", -2.0)]
    pieces += [(f"▁{word}", -1.0) for word in PROMPT_WORDS]
    pieces += [(f"▁{char}", -8.0) for char in CHARACTERS]
    pieces += [(char, -9.0) for char in CHARACTERS]
    scores: dict[str, float] = {}
    for piece, score in pieces:
        scores.setdefault(piece, score)  # "▁a" is both a word and a letter: the word's score wins
    return T5Tokenizer(vocab=list(scores.items()), extra_ids=0, model_max_length=model_max_length)


def build_clip_tokenizer(*, model_max_length: int = 77) -> CLIPTokenizer:
    """A CLIP (byte-level BPE, lower-cased, ``</w>`` word ends) tokenizer with `PROMPT_WORDS` as single tokens."""
    from transformers import CLIPTokenizer

    alphabet = _byte_level_alphabet()
    words = sorted({word.lower() for word in PROMPT_WORDS})
    merges, merged = _chain_merges([[*word[:-1], word[-1] + "</w>"] for word in words], right_to_left=True)
    specials = ["<|startoftext|>", "<|endoftext|>"]
    vocab = _index(alphabet + [symbol + "</w>" for symbol in alphabet] + merged + specials)
    return CLIPTokenizer(vocab=vocab, merges=merges, model_max_length=model_max_length)


# Qwen2.5-VL's special tokens: chat-template markers the Qwen-Image pipeline wraps every prompt in, and the
# vision markers the text encoder's config names (kept so that its token ids point at real tokens).
QWEN_SPECIAL_TOKENS = (
    "<|im_start|>",
    "<|im_end|>",
    "<|vision_start|>",
    "<|vision_end|>",
    "<|image_pad|>",
    "<|video_pad|>",
)

# Words of the Qwen-Image system prompt that start a line, so they are not preceded by a space ("Ġ"). Their
# merge chains may clash with one another, so only these few get one; the tests check they stay one token each.
QWEN_BARE_WORDS = ("system", "user", "assistant", "Describe")


def build_qwen2_tokenizer(*, model_max_length: int = 32768) -> Qwen2Tokenizer:
    """A Qwen2 (GPT-2-style byte-level BPE) tokenizer with `PROMPT_WORDS` as single tokens: the Qwen-Image
    pipeline drops as many leading tokens (its system prompt) as the real tokenizer makes of it, and every
    template word is one token here too (`tests/models` checks the count against the installed pipeline)."""
    from transformers import Qwen2Tokenizer

    alphabet = _byte_level_alphabet()
    space = "\u0120"  # "Ġ": how byte-level BPE spells a leading space
    # A chain for a word after a space starts with "Ġ", which never occurs inside a word, so it cannot clash
    # with another chain; ranking the bare chains last lets every "Ġ" chain finish first.
    spaced_merges, spaced_tokens = _chain_merges([[space, *word] for word in PROMPT_WORDS], right_to_left=False)
    bare_merges, bare_tokens = _chain_merges([list(word) for word in QWEN_BARE_WORDS], right_to_left=False)
    vocab = _index(["<|endoftext|>"] + alphabet + spaced_tokens + bare_tokens)
    tokenizer = Qwen2Tokenizer(vocab=vocab, merges=spaced_merges + bare_merges, model_max_length=model_max_length)
    tokenizer.add_special_tokens({"additional_special_tokens": list(QWEN_SPECIAL_TOKENS)})
    return tokenizer
