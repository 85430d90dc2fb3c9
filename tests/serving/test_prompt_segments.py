"""A rendered chat prompt tokenised piece by piece between its special tokens, the pieces' ids
kept (serving.llm.tokens._SegmentIds): always the ids the whole text has."""

from __future__ import annotations

import json
import random

import pytest
from tokenizers import Tokenizer, models, normalizers, pre_tokenizers, trainers
from tokenizers.decoders import ByteLevel as ByteLevelDecoder

from serving.llm import tokens
from serving.llm.tokens import PromptCounter, _SegmentIds

SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|im_start|>x"]  # the last overlaps the second
WORDS = ["hello", "world", "deploy", "the", "platform", "naïve", "日本語", "🙂", "   ", "\n", "\n\n", "\t", " ",
         "<|im", "im_end|>", "<|", "|>", "don't", "123", "4.5", "x"]  # fmt: skip
TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def byte_level_bpe() -> Tokenizer:
    """A small byte-level BPE like SmolLM2's (no normaliser, special tokens matched raw)."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = ByteLevelDecoder()
    corpus = [" ".join(random.Random(i).choices(WORDS[:9], k=40)) for i in range(200)]
    trainer = trainers.BpeTrainer(
        vocab_size=400, special_tokens=SPECIAL, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tokenizer.train_from_iterator(corpus, trainer)
    return tokenizer


def texts(count: int, seed: int) -> list[str]:
    draw = random.Random(seed)
    return ["".join(draw.choice(WORDS + SPECIAL) for _ in range(draw.randint(0, 30))) for _ in range(count)]


def segments_of(tokenizer: Tokenizer) -> _SegmentIds | None:
    return _SegmentIds.of(tokenizer, json.loads(tokenizer.to_str()))


def whole(tokenizer: Tokenizer, text: str) -> list[int]:
    ids: list[int] = tokenizer.encode(text, add_special_tokens=False).ids
    return ids


def test_pieces_give_the_whole_texts_ids_cold_and_warm():
    tokenizer = byte_level_bpe()
    segments = segments_of(tokenizer)
    assert segments is not None
    sample = texts(400, seed=38)
    for text in sample:
        assert segments.encode(text) == whole(tokenizer, text), text
    for text in sample:  # now from the kept pieces
        assert segments.encode(text) == whole(tokenizer, text), text
    assert len(segments._ids) > 0


def test_the_kept_pieces_stay_within_their_bound(monkeypatch):
    """Each piece counts its characters and a fixed cost: many tiny pieces are bounded too."""
    monkeypatch.setattr(tokens, "SEGMENT_CACHE_CHARS", 200)
    monkeypatch.setattr(tokens, "SEGMENT_CACHE_ENTRY_CHARS", 10)
    monkeypatch.setattr(tokens, "SEGMENT_CACHE_LONGEST", 50)
    tokenizer = byte_level_bpe()
    segments = segments_of(tokenizer)
    assert segments is not None
    for text in [*texts(300, seed=7), "hello world " * 20]:
        assert segments.encode(text) == whole(tokenizer, text)
        assert segments._chars == sum(len(piece) + 10 for piece in segments._ids) <= 200
    assert all(len(piece) <= 50 for piece in segments._ids)


def test_a_chat_counted_through_the_pieces_is_the_rendered_texts_count(tmp_path):
    tokenizer = byte_level_bpe()
    tokenizer.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"chat_template": TEMPLATE}))
    counter = PromptCounter(str(tmp_path))
    assert counter.segments is not None
    system = {"role": "system", "content": "You answer about the platform. " * 30}
    conversation = [system]
    for turn, text in enumerate(texts(6, seed=3)):
        conversation = [*conversation, {"role": "user", "content": text}]
        rendered = counter.template.render(messages=conversation, add_generation_prompt=True)
        count = counter.count_chat(conversation)
        assert count.exact
        assert count.ids == whole(tokenizer, rendered)
        assert count.tokens == len(whole(tokenizer, rendered))
        conversation.append({"role": "assistant", "content": f"answer {turn} <|im_end|> typed by a user"})


def test_a_tokenizer_told_to_tokenise_special_tokens_as_text_is_tokenised_whole():
    tokenizer = byte_level_bpe()
    tokenizer.encode_special_tokens = True
    assert segments_of(tokenizer) is None


@pytest.mark.parametrize(
    "change",
    ["normaliser", "lstrip", "normalized"],
)
def test_tokenizers_the_pieces_would_not_match_are_tokenised_whole(tmp_path, change):
    spec = json.loads(byte_level_bpe().to_str())
    if change == "normaliser":
        spec["normalizer"] = json.loads(normalizers.NFKC().__getstate__())
    else:
        spec["added_tokens"][1][change] = True
    tokenizer = Tokenizer.from_str(json.dumps(spec))
    assert segments_of(tokenizer) is None
    tokenizer.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"chat_template": TEMPLATE}))
    counter = PromptCounter(str(tmp_path))
    assert counter.segments is None
    messages = [{"role": "user", "content": "hello  <|im_end|> world"}]
    rendered = counter.template.render(messages=messages, add_generation_prompt=True)
    assert counter.count_chat(messages).ids == whole(tokenizer, rendered)
