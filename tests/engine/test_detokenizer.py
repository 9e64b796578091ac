import pytest

from jaxserve.engine.detokenizer import IncrementalDetokenizer
from jaxserve.engine.request import Request
from jaxserve.sampling_params import SamplingParams

TEXTS = [
    "Hello world, this is a test of the tokenizer.",
    "Café crème brûlée — déjà vu at the naïve résumé.",
    "日本語のテキスト, then 日本 again.",
    "Emoji 😀🎉 and 🚀 mixed with words 🤖!",
    "Unseen words: zyxt qqq ÆØÅ ∑∫√ 한국어 🙈",
]


def make_detok(tokenizer, prompt="Say:", **params):
    prompt_ids = tokenizer.encode(prompt, add_special_tokens=False)
    req = Request("r", prompt_ids, SamplingParams(max_tokens=1000, **params), seed=0, max_tokens=1000)
    return IncrementalDetokenizer(tokenizer, req)


def feed(detok, ids):
    """Feed one token at a time; return the stop string and the text after each token."""
    texts = []
    for token in ids:
        stop = detok.update([token])
        texts.append(detok.output_text)
        if stop is not None:
            return stop, texts
    return None, texts


@pytest.mark.parametrize("text", TEXTS)
@pytest.mark.parametrize("skip_special_tokens", [True, False])
def test_incremental_text_matches_full_decode(byte_tokenizer, text, skip_special_tokens):
    tok = byte_tokenizer
    special = tok.convert_tokens_to_ids(["<|im_start|>", "<|endoftext|>"])
    half = len(text) // 2
    ids = tok.encode(text[:half]) + special[:1] + tok.encode(text[half:]) + special[1:]
    detok = make_detok(tok, skip_special_tokens=skip_special_tokens)
    held_back = 0
    _, texts = feed(detok, ids)
    for i, incremental in enumerate(texts):
        full = tok.decode(ids[: i + 1], skip_special_tokens=skip_special_tokens)
        if full.endswith("\ufffd"):  # half a character: held back until complete
            held_back += 1
            assert full.startswith(incremental) and len(incremental) < len(full)
        else:
            assert incremental == full
    assert texts[-1] == tok.decode(ids, skip_special_tokens=skip_special_tokens)
    if any(ord(c) > 0xFFFF or c in "日語한" for c in text):
        assert held_back > 0, "this text should split a character across tokens"


def test_output_after_a_prompt_keeps_its_leading_space(metaspace_tokenizer):
    """A "▁word" token decodes without its space at the start of a string; as a
    continuation of the prompt it must keep it."""
    tok = metaspace_tokenizer
    prompt_ids = tok.encode("The quick brown", add_special_tokens=False)
    out_ids = tok.encode(" fox jumps over the lazy dog. Café 日本!", add_special_tokens=False)
    full_ids = prompt_ids + out_ids
    assert tok.decode(out_ids).startswith("fox")  # the naive decode loses the space
    req = Request("r", prompt_ids, SamplingParams(), seed=0, max_tokens=100)
    detok = IncrementalDetokenizer(tok, req)
    prompt_text = tok.decode(prompt_ids)
    for i, token in enumerate(out_ids):
        detok.update([token])
        assert detok.output_text == tok.decode(full_ids[: len(prompt_ids) + i + 1])[len(prompt_text) :]
    assert detok.output_text.startswith(" fox")


def test_many_tokens_in_one_update(byte_tokenizer):
    ids = byte_tokenizer.encode(TEXTS[3])
    detok = make_detok(byte_tokenizer)
    detok.update(ids[:5])
    detok.update(ids[5:])
    assert detok.output_text == byte_tokenizer.decode(ids)


def test_decoding_is_windowed_not_quadratic(byte_tokenizer):
    calls = []

    class Spy:
        is_fast = True

        def decode(self, ids, **kwargs):
            calls.append(len(ids))
            return byte_tokenizer.decode(ids, **kwargs)

    ids = byte_tokenizer.encode(" ".join(TEXTS) * 4)
    detok = make_detok(byte_tokenizer)
    detok.tokenizer = Spy()
    for token in ids:
        detok.update([token])
    assert detok.output_text == byte_tokenizer.decode(ids)
    assert len(ids) > 300 and max(calls) < 16


def test_stop_string_spanning_tokens_is_cut(byte_tokenizer):
    tok = byte_tokenizer
    text = "The quick brown fox jumps over the lazy dog."
    ids = tok.encode(text)
    detok = make_detok(tok, stop=["lazy dog"])
    # The stop string is split over several tokens.
    assert not any("lazy dog" in tok.decode([t]) for t in ids)
    stop, texts = feed(detok, ids)
    assert stop == "lazy dog"
    assert detok.output_text == "The quick brown fox jumps over the "
    assert detok.stop_string == "lazy dog"
    assert detok.update(tok.encode(" more")) is None  # finished: no more text
    assert detok.output_text == "The quick brown fox jumps over the "


def test_include_stop_str_in_output(byte_tokenizer):
    tok = byte_tokenizer
    ids = tok.encode("Stop here. STOP! Then continue.")
    detok = make_detok(tok, stop=["STOP"], include_stop_str_in_output=True)
    stop, _ = feed(detok, ids)
    assert stop == "STOP"
    assert detok.output_text == "Stop here. STOP"


def test_text_after_the_stop_string_in_the_same_token_is_dropped(byte_tokenizer):
    tok = byte_tokenizer
    ids = tok.encode("abc, then the end")
    for include in (False, True):
        detok = make_detok(tok, stop=["c"], include_stop_str_in_output=include)
        assert detok.update(ids) == "c"
        assert detok.output_text == ("abc" if include else "ab")


def test_the_earliest_stop_string_wins(byte_tokenizer):
    ids = byte_tokenizer.encode("hello world")
    detok = make_detok(byte_tokenizer, stop=["world", "o"])
    assert detok.update(ids) == "o"
    assert detok.output_text == "hell"


def test_stop_strings_do_not_match_inside_the_prompt(byte_tokenizer):
    tok = byte_tokenizer
    detok = make_detok(tok, prompt="Please STOP", stop=["STOP"])
    stop, _ = feed(detok, tok.encode(" now. Then STOP"))
    assert stop == "STOP"
    assert detok.output_text == " now. Then "
    # A stop string straddling prompt and output does not count either.
    detok = make_detok(tok, prompt="Please ST", stop=["STOP"])
    assert feed(detok, tok.encode("OP it"))[0] is None
    assert detok.output_text == "OP it"


def test_stop_strings_wait_for_min_tokens(byte_tokenizer):
    tok = byte_tokenizer
    ids = tok.encode("ab ab ab")
    detok = make_detok(tok, stop=["ab"], min_tokens=len(tok.encode("ab ab")))
    stop, _ = feed(detok, ids)
    assert stop == "ab"
    assert detok.output_text == "ab ab "


def test_stop_terminated_token_is_not_detokenized(byte_tokenizer):
    tok = byte_tokenizer
    eos = tok.eos_token_id
    ids = tok.encode("Hi there") + [eos]
    detok = make_detok(tok, skip_special_tokens=False)
    detok.update(ids[:-1])
    detok.update(ids[-1:], stop_terminated=True)
    assert detok.output_text == "Hi there"
    detok = make_detok(tok, skip_special_tokens=False, include_stop_str_in_output=True)
    detok.update(ids, stop_terminated=True)
    assert detok.output_text == "Hi there<|endoftext|>"


def test_streaming_holds_back_a_possible_stop_string(byte_tokenizer):
    tok = byte_tokenizer
    text = "Hello world, this is a test of the tokenizer."
    ids = tok.encode(text)
    stop = "tokenizer"
    detok = make_detok(tok, stop=[stop, "xyz"])
    streamed = ""
    for token in ids:
        found = detok.update([token])
        finished = found is not None
        delta = detok.get_delta(finished)
        streamed += delta
        if not finished:
            assert len(detok.output_text) - len(streamed) <= len(stop) - 1
            assert streamed == detok.output_text[: max(len(detok.output_text) - (len(stop) - 1), 0)]
        assert "tok" + "enizer" not in streamed
        if finished:
            break
    assert streamed == detok.output_text == "Hello world, this is a test of the "
    assert detok.get_delta(True) == ""


def test_streaming_without_stop_strings_is_immediate(byte_tokenizer):
    tok = byte_tokenizer
    ids = tok.encode(TEXTS[0])
    detok = make_detok(tok)
    streamed = ""
    for token in ids:
        detok.update([token])
        streamed += detok.get_delta(False)
        assert streamed == detok.output_text
    assert detok.get_delta(True) == ""


def test_streaming_releases_the_held_back_text_when_finished(byte_tokenizer):
    tok = byte_tokenizer
    ids = tok.encode("no stop in here")
    detok = make_detok(tok, stop=["never appears"])
    detok.update(ids)
    assert detok.get_delta(False) == "no "  # the last 12 characters may begin a stop string
    assert detok.get_delta(True) == "stop in here"


def test_streaming_with_include_stop_str_does_not_hold_back(byte_tokenizer):
    tok = byte_tokenizer
    detok = make_detok(tok, stop=["never appears"], include_stop_str_in_output=True)
    detok.update(tok.encode("no stop in here"))
    assert detok.get_delta(False) == "no stop in here"
