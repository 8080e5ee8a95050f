"""Tests for IncrementalDetokenizer and the stop checks, with a real byte-level BPE."""

from __future__ import annotations

import random

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from pd_cluster.engine.detokenizer import IncrementalDetokenizer
from pd_cluster.engine.stop_checker import StopChecker, check_stop, check_token_stop
from pd_cluster.sampling_params import SamplingParams

CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "héllo wörld, ça va? naïve café résumé",
    "日本語のテキストも少し含めます。東京は大きい。",
    "emoji time 🙂 🚀 👍🏽 and more",
    "def f(x):\n    return x * 2  # code\n",
    "Hello world! Hello there. STOP here, then ### end.",
] * 20


@pytest.fixture(scope="module")
def tok() -> PreTrainedTokenizerFast:
    t = Tokenizer(models.BPE())
    t.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    t.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400,
        special_tokens=["<eos>", "<bos>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    t.train_from_iterator(CORPUS, trainer=trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=t, eos_token="<eos>", bos_token="<bos>", clean_up_tokenization_spaces=False
    )


def _stream(tok: PreTrainedTokenizerFast, prompt: list[int], out: list[int], skip: bool = True) -> tuple[list[str], IncrementalDetokenizer]:
    d = IncrementalDetokenizer(tok, prompt, skip_special_tokens=skip)
    deltas = [d.append(t) for t in out]
    return deltas, d


@pytest.mark.parametrize(
    "text",
    ["héllo wörld 日本語 🙂", " Hello world", "🚀🚀👍🏽 naïve", "x = 1\n\n  y", "日本語のテキスト"],
)
def test_concat_equals_decode(tok: PreTrainedTokenizerFast, text: str) -> None:
    ids = tok.encode(text, add_special_tokens=False)
    for prompt in ([], tok.encode("Prompt: ", add_special_tokens=False)):
        deltas, d = _stream(tok, prompt, ids)
        assert "".join(deltas) == tok.decode(ids) == text
        assert d.text == text
        # Partial multi-byte characters must never leak out.
        assert all("\ufffd" not in x for x in deltas)


def test_multibyte_split_across_tokens(tok: PreTrainedTokenizerFast) -> None:
    # Feed raw single-byte tokens so every CJK/emoji char spans several tokens.
    text = "日本語 🙂"
    byte_tokens = [tok.convert_tokens_to_ids(c) for c in _byte_level_chars(text)]
    assert len(byte_tokens) == len(text.encode())
    deltas, d = _stream(tok, [], byte_tokens)
    assert d.text == text
    assert [x for x in deltas if x] == ["日", "本", "語", " ", "🙂"]


def _byte_level_chars(text: str) -> list[str]:
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    table = bytes_to_unicode()
    return [table[b] for b in text.encode()]


def test_random_text_sequences(tok: PreTrainedTokenizerFast) -> None:
    rng = random.Random(0)
    alphabet = list("abc xyz  ,.\n") + list("éöç日本語東京🙂🚀👍🏽")
    for _ in range(50):
        text = "".join(rng.choice(alphabet) for _ in range(rng.randint(1, 40)))
        ids = tok.encode(text, add_special_tokens=False)
        prompt = tok.encode("".join(rng.choice(alphabet) for _ in range(rng.randint(0, 10))), add_special_tokens=False)
        deltas, d = _stream(tok, prompt, ids)
        assert "".join(deltas) == tok.decode(ids) == d.text


def test_random_token_ids(tok: PreTrainedTokenizerFast) -> None:
    # Arbitrary output ids can form invalid UTF-8 anywhere; after flush() the
    # text still matches a full decode. (The prompt must end on a character
    # boundary: if it ends mid-character, the output's first bytes complete a
    # prompt character and "the output text" is inherently ambiguous.)
    rng = random.Random(1)
    n_vocab = len(tok)
    for _ in range(200):
        ids = [rng.randrange(2, n_vocab) for _ in range(rng.randint(1, 30))]
        prompt = tok.encode(rng.choice(CORPUS)[: rng.randint(0, 20)], add_special_tokens=False)
        deltas, d = _stream(tok, prompt, ids)
        deltas.append(d.flush())
        assert "".join(deltas) == tok.decode(ids) == d.text


def test_leading_space_kept_with_prompt_context(tok: PreTrainedTokenizerFast) -> None:
    prompt = tok.encode("Hello", add_special_tokens=False)
    out = tok.encode(" world", add_special_tokens=False)
    deltas, d = _stream(tok, prompt, out)
    assert d.text == " world"


def test_skip_special_tokens(tok: PreTrainedTokenizerFast) -> None:
    ids = tok.encode("Hello", add_special_tokens=False) + [tok.eos_token_id]
    _, d = _stream(tok, [], ids, skip=True)
    assert d.text == "Hello"
    _, d = _stream(tok, [], ids, skip=False)
    assert d.text == "Hello<eos>"


def test_out_of_vocab_id_is_ignored(tok: PreTrainedTokenizerFast) -> None:
    ids = tok.encode("Hello", add_special_tokens=False)
    d = IncrementalDetokenizer(tok, [])
    for t in ids:
        d.append(t)
    assert d.append(len(tok) + 10) == ""
    assert d.text == "Hello" and d.output_token_ids[-1] == len(tok) + 10


# ---------------------------------------------------------------- stop checks


def _run_with_stops(tok: PreTrainedTokenizerFast, text: str, params: SamplingParams) -> tuple[str, str | None]:
    """Engine-like loop: returns (final text, finish reason)."""
    ids = tok.encode(text, add_special_tokens=False)
    d = IncrementalDetokenizer(tok, [], params.skip_special_tokens)
    checker = StopChecker(params, tok.eos_token_id)
    out: list[int] = []
    for t in ids:
        out.append(t)
        reason = checker.check_token(out)
        if reason == "stop":
            return d.text, reason
        delta = d.append(t)
        stop_str, pos = checker.check_text(d.text, len(delta), len(out))
        if stop_str is not None:
            d.truncate(pos)  # type: ignore[arg-type]
            return d.text, "stop"
        if reason is not None:
            return d.text, reason
    return d.text, None


def test_stop_string_spanning_tokens(tok: PreTrainedTokenizerFast) -> None:
    text = "Hello world! Hello there. STOP here, then more"
    stop = "lo the"  # spans tokens "Hello" / " there"
    ids = tok.encode(text, add_special_tokens=False)
    pieces = [tok.decode([i]) for i in ids]
    assert not any(stop in p for p in pieces)  # really spans tokens
    assert _run_with_stops(tok, text, SamplingParams(stop=stop, max_tokens=100)) == ("Hello world! Hel", "stop")
    assert _run_with_stops(tok, text, SamplingParams(stop=[stop], include_stop_str_in_output=True, max_tokens=100)) == (
        "Hello world! Hello the",
        "stop",
    )


def test_earliest_stop_string_wins(tok: PreTrainedTokenizerFast) -> None:
    text = "Hello world! Hello there."
    assert _run_with_stops(tok, text, SamplingParams(stop=["there", "world"], max_tokens=100)) == ("Hello ", "stop")


def test_check_stop_window_and_trim() -> None:
    p = SamplingParams(stop=["abc"])
    # Match entirely in old text is not re-reported.
    assert check_stop("xxabcyyy", 3, p) == (None, None)
    # Match straddling old/new boundary is found; text after is trimmed.
    assert check_stop("xxabcyy", 4, p) == ("abc", 2)
    p2 = SamplingParams(stop=["abc"], include_stop_str_in_output=True)
    assert check_stop("xxabcyy", 4, p2) == ("abc", 5)
    assert check_stop("abc", 0, p) == (None, None)
    # min_tokens gates stop strings.
    p3 = SamplingParams(stop=["abc"], min_tokens=3)
    assert check_stop("xxabc", 3, p3, num_output_tokens=3) == (None, None)
    assert check_stop("xxabc", 3, p3, num_output_tokens=4) == ("abc", 2)


def test_token_stops() -> None:
    eos = 0
    p = SamplingParams(max_tokens=5, stop_token_ids=[7])
    assert check_token_stop([3], eos, p) is None
    assert check_token_stop([3, eos], eos, p) == "stop"
    assert check_token_stop([3, 7], eos, p) == "stop"
    assert check_token_stop([1, 2, 3, 4, 5], eos, p) == "length"
    assert check_token_stop([1, 2, 3, 4, eos], eos, p) == "stop"  # natural stop wins
    # ignore_eos: EOS is an ordinary token; only length ends it.
    pi = SamplingParams(max_tokens=3, ignore_eos=True)
    assert check_token_stop([eos], eos, pi) is None
    assert check_token_stop([eos, eos, eos], eos, pi) == "length"
    # min_tokens: a stop token needs min_tokens ordinary tokens before it.
    pm = SamplingParams(min_tokens=2, stop_token_ids=[7])
    assert check_token_stop([1, eos], eos, pm) is None
    assert check_token_stop([1, 7], eos, pm) is None
    assert check_token_stop([1, 2, eos], eos, pm) == "stop"
    # max_tokens=None: unbounded except by max_model_len.
    pn = SamplingParams(max_tokens=None)
    assert check_token_stop([1] * 1000, eos, pn) is None
    assert check_token_stop([1] * 6, eos, pn, num_prompt_tokens=10, max_model_len=16) == "length"


def test_stop_checker_records_reason() -> None:
    c = StopChecker(SamplingParams(stop_token_ids=[7], stop=["zz"]), eos_token_id=0)
    assert c.check_token([1, 7]) == "stop" and c.stop_reason == 7
    c2 = StopChecker(SamplingParams(stop=["zz"]), eos_token_id=0)
    assert c2.check_token([1, 0]) == "stop" and c2.stop_reason is None
    assert c2.check_text("azz", 2, 2) == ("zz", 1) and c2.stop_reason == "zz"


def test_engine_loop_eos_max_tokens_ignore_eos(tok: PreTrainedTokenizerFast) -> None:
    ids = tok.encode("Hello world", add_special_tokens=False)
    eos = tok.eos_token_id
    seq = ids + [eos] + ids

    def run(params: SamplingParams) -> tuple[str, str | None]:
        d = IncrementalDetokenizer(tok, [], params.skip_special_tokens)
        out: list[int] = []
        for t in seq:
            out.append(t)
            reason = check_token_stop(out, eos, params)
            if reason != "stop":
                d.append(t)
            if reason:
                return d.text, reason
        return d.text, None

    assert run(SamplingParams(max_tokens=100)) == ("Hello world", "stop")
    # EOS text is not emitted even when special tokens are not skipped.
    assert run(SamplingParams(max_tokens=100, skip_special_tokens=False)) == ("Hello world", "stop")
    assert run(SamplingParams(max_tokens=len(ids) + 2, ignore_eos=True)) == (
        tok.decode(ids + [eos, ids[0]], skip_special_tokens=True),
        "length",
    )
    assert run(SamplingParams(max_tokens=1)) == (tok.decode(ids[:1]), "length")
    assert run(SamplingParams(max_tokens=100, stop_token_ids=[ids[1]])) == (tok.decode(ids[:1]), "stop")
