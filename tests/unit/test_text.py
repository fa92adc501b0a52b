import pytest

from gateway.text import Detokenizer, StopMatcher, decode_delta


@pytest.fixture(scope="module")
def tokenizer():
    from transformers import AutoTokenizer

    from pdserve.model import default_model_path

    path = default_model_path()
    if not (path / "tokenizer.json").exists():
        pytest.skip("default model not prepared (make test prepares it)")
    return AutoTokenizer.from_pretrained(path)


def stream(tokenizer, ids, chunk):
    detok, out = Detokenizer(), []
    for start in range(0, len(ids), chunk):
        window, read_offset = detok.window(ids[start:start + chunk])
        prefix = tokenizer.decode(window[:read_offset], skip_special_tokens=True)
        full = tokenizer.decode(window, skip_special_tokens=True)
        out.append(detok.advance(decode_delta(prefix, full, final=start + chunk >= len(ids))))
    return out


@pytest.mark.parametrize("chunk", [1, 2, 5])
def test_incremental_text_equals_full_decode_and_never_splits_a_character(tokenizer, chunk):
    text = "Prix: 15 € — naïve café, 東京タワー 🙂🚀 ok"
    ids = tokenizer.encode(text)
    assert len(ids) > len(text.split())  # multi-byte characters span several tokens
    deltas = stream(tokenizer, ids, chunk)
    assert "".join(deltas) == tokenizer.decode(ids, skip_special_tokens=True)
    assert not any("\ufffd" in d for d in deltas)


def test_decode_delta_waits_for_a_complete_character():
    assert decode_delta("ab", "ab\ufffd", final=False) is None
    assert decode_delta("ab", "ab\ufffd", final=True) == "\ufffd"
    assert decode_delta("ab", "abc", final=False) == "c"
    assert decode_delta("ab", "ab", final=False) is None


def test_stop_matcher_holds_back_a_possible_stop_and_cuts_at_it():
    m = StopMatcher(("STOP",))
    assert m.feed("hello S") == "hell"
    assert m.feed("T") == "o"  # "hello ST": the last 3 characters could start "STOP"
    assert not m.stopped
    assert m.feed("OP and more") == " "
    assert m.stopped


def test_stop_matcher_flushes_held_text_when_no_stop_comes():
    m = StopMatcher(("xyz",))
    assert m.feed("abcx") == "ab"
    assert m.flush() == "cx"


def test_stop_matcher_picks_the_earliest_stop_and_passes_everything_without_stops():
    m = StopMatcher(("c", "ab"))
    assert m.feed("zabc") == "z"
    assert m.stopped
    free = StopMatcher(())
    assert free.feed("abc") == "abc" and free.flush() == ""
