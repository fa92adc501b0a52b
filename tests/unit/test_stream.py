"""Stream.reply and IncrementalDecoder against the gateway's previous path: the same text for
the same ids, where that path decoded two windows per message in the tokenizer pool."""

import random
from dataclasses import dataclass, field

import pytest
from tokenizers import Tokenizer, decoders, models

from gateway.request import Job, Sampling
from gateway.stream import Stream
from gateway.text import Detokenizer, IncrementalDecoder, StopMatcher, decode_delta, load_tokenizer
from pdserve.model import default_model_path

SPECIAL_IDS = range(17)  # <|endoftext|>, <|im_start|>, <|im_end|>, ... in SmolLM2's vocabulary


@pytest.fixture(scope="module")
def model_path():
    path = default_model_path()
    if not (path / "tokenizer.json").exists():
        pytest.skip("default model not prepared (make test prepares it)")
    return path


@pytest.fixture(scope="module")
def tokenizer(model_path):
    return load_tokenizer(model_path)


@pytest.fixture(scope="module")
def hf_tokenizer(model_path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_path)


def pool_path_deltas(tokenizer, chunks):
    """The text each message got before: Detokenizer windows decoded as the pool did."""
    detok, out = Detokenizer(), []
    for i, chunk in enumerate(chunks):
        window, read_offset = detok.window(chunk)
        prefix = tokenizer.decode(window[:read_offset], skip_special_tokens=True)
        full = tokenizer.decode(window, skip_special_tokens=True)
        out.append(detok.advance(decode_delta(prefix, full, final=i == len(chunks) - 1)))
    return out


def decoder_deltas(tokenizer, chunks):
    decoder = IncrementalDecoder(tokenizer)
    return [decoder.step(chunk, final=i == len(chunks) - 1) for i, chunk in enumerate(chunks)]


def split(ids, rng, max_chunk):
    chunks, i = [], 0
    while i < len(ids):
        n = rng.randint(0, max_chunk)  # 0: a message with no new ids
        chunks.append(ids[i:i + n])
        i += n
    return chunks + [[]] if rng.random() < 0.2 else chunks or [[]]


def byte_ids(tokenizer, text):
    """One token per UTF-8 byte, so every multi-byte character spans several messages."""
    byte_to_char = {b: c for b, c in zip(range(256), _bytes_to_unicode())}
    return [tokenizer.token_to_id(byte_to_char[b]) for b in text.encode()]


def _bytes_to_unicode():
    # GPT-2's byte-level alphabet: printable bytes map to themselves, the rest to U+0100 on.
    printable = [*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    chars, extra = [], 0
    for b in range(256):
        if b in printable:
            chars.append(chr(b))
        else:
            chars.append(chr(256 + extra))
            extra += 1
    return chars


def test_byte_tokens_split_characters(tokenizer):
    ids = byte_ids(tokenizer, "é東🙂")
    assert len(ids) == 2 + 3 + 4
    assert tokenizer.decode(ids) == "é東🙂"
    assert tokenizer.decode(ids[:2]) == "é" and tokenizer.decode(ids[:3]) == "é\ufffd"


@pytest.mark.parametrize("seed", range(6))
def test_random_ids_give_the_pool_paths_text(tokenizer, hf_tokenizer, seed):
    rng = random.Random(seed)
    vocab = tokenizer.get_vocab_size()
    for _ in range(150):
        ids = [rng.randrange(vocab) for _ in range(rng.randint(1, 40))]
        for _ in range(rng.randint(0, 3)):
            ids.insert(rng.randrange(len(ids) + 1), rng.choice(SPECIAL_IDS))
        chunks = split(ids, rng, max_chunk=4)
        assert decoder_deltas(tokenizer, chunks) == pool_path_deltas(hf_tokenizer, chunks)


TRICKY = [
    "Prix: 15 € — naïve café, 東京タワー 🙂🚀 ok",
    "👩‍👩‍👧 family, 🇫🇷 flag, e\u0301 combining",
    "\n\n  indented\tcode();\r\n",
]


@pytest.mark.parametrize("text", TRICKY)
@pytest.mark.parametrize("max_chunk", [1, 3, 7])
def test_split_characters_and_special_tokens_give_the_pool_paths_text(
    tokenizer, hf_tokenizer, text, max_chunk
):
    rng = random.Random(max_chunk)
    for ids in (tokenizer.encode(text).ids, byte_ids(tokenizer, text)):
        ids = [2] + ids[:5] + [1, 0] + ids[5:] + [2]  # <|im_end|>, <|im_start|>, <|endoftext|>
        for _ in range(20):
            chunks = split(ids, rng, max_chunk)
            deltas = decoder_deltas(tokenizer, chunks)
            assert deltas == pool_path_deltas(hf_tokenizer, chunks)
            assert "".join(deltas) == text
            assert not any("\ufffd" in d for d in deltas)


def test_a_trailing_incomplete_character_waits_and_the_last_message_flushes_it(tokenizer, hf_tokenizer):
    ids = byte_ids(tokenizer, "ab🙂")[:4]  # "ab" and the first two bytes of the emoji
    chunks = [ids[:1], ids[1:3], ids[3:], []]
    # "b" arrives with the emoji's first byte, so it waits with it: text is released per window.
    assert decoder_deltas(tokenizer, chunks) == ["a", "", "", "b\ufffd"]
    assert pool_path_deltas(hf_tokenizer, chunks) == ["a", "", "", "b\ufffd"]


def test_the_mirrored_window_stays_short_so_each_step_costs_the_same(tokenizer):
    decoder = IncrementalDecoder(tokenizer)
    ids = tokenizer.encode("word " * 500).ids
    for i in ids:
        decoder.step([i], final=False)
    assert len(decoder._window) == 1  # the last emitted token, context for the next


def test_a_decoder_that_rewrites_its_prefix_falls_back_to_decoding_both_windows():
    # Fuse then Replace("ab" -> "X"): "a" then "X": the text before no longer starts the
    # text after, which DecodeStream refuses; the gateway's old slicing goes on.
    toy = Tokenizer(models.WordLevel({"a": 0, "b": 1, "c": 2, "[UNK]": 3}, unk_token="[UNK]"))
    toy.decoder = decoders.Sequence([decoders.Fuse(), decoders.Replace("ab", "X")])
    assert decoder_deltas(toy, [[0], [1], [2], [0], [2]]) == ["a", "", "c", "a", "c"]
    rng = random.Random(0)
    for _ in range(200):
        chunks = split([rng.randrange(3) for _ in range(rng.randint(1, 12))], rng, max_chunk=3)
        assert decoder_deltas(toy, chunks) == pool_path_deltas(toy, chunks)


# --- Stream ------------------------------------------------------------------------------


@dataclass
class RecordingObserver:
    events: list = field(default_factory=list)

    def first_token(self, job, ttft_s):
        self.events.append(("first", job.request_id))

    def tokens(self, job, num_tokens, gap_s):
        assert gap_s >= 0
        self.events.append(("tokens", num_tokens))

    def finished(self, job, e2e_s, num_prompt_tokens, num_generated):
        self.events.append(("finished", num_prompt_tokens, num_generated))


def make_job(stop=()):
    sampling = Sampling(
        max_tokens=64, temperature=0.0, top_p=1.0, top_k=0, seed=None, stop=tuple(stop),
        stop_token_ids=(), ignore_eos=False,
    )
    return Job(request_id="r1", prompt="hi", messages=None, token_ids=None, sampling=sampling)


def pool_path_texts(hf_tokenizer, chunks, finish_reason, stop):
    """Today's _reply texts and finish reasons, message by message, until a stop."""
    matcher, out = StopMatcher(tuple(stop)), []
    for i, delta in enumerate(pool_path_deltas(hf_tokenizer, chunks)):
        reason = finish_reason if i == len(chunks) - 1 else ""
        text = matcher.feed(delta)
        if matcher.stopped:
            out.append((text, "stop"))
            return out
        out.append((text + matcher.flush() if reason else text, reason))
    return out


def run_stream(tokenizer, chunks, finish_reason, stop=(), observer=None):
    stream = Stream(make_job(stop), 7, tokenizer, observer=observer or RecordingObserver())
    replies = []
    for i, chunk in enumerate(chunks):
        reply = stream.reply(chunk, finish_reason if i == len(chunks) - 1 else "")
        replies.append(reply)
        if reply.finish_reason:
            break
    return stream, replies


@pytest.mark.parametrize("max_chunk", [1, 2, 5])
def test_stop_strings_across_messages_cut_the_text_as_before(tokenizer, hf_tokenizer, max_chunk):
    text = "Le café coûte 3 €. FIN du texte 東京 après"
    rng = random.Random(max_chunk)
    for ids in (tokenizer.encode(text).ids, byte_ids(tokenizer, text)):
        for stop in (("FIN",), ("€.",), ("京",), ("é c", "xyz"), ("absent",)):
            chunks = split(ids, rng, max_chunk)
            _, replies = run_stream(tokenizer, chunks, "length", stop)
            got = [(r.text, r.finish_reason) for r in replies]
            assert got == pool_path_texts(hf_tokenizer, chunks, "length", stop)
    _, replies = run_stream(tokenizer, [tokenizer.encode(text).ids], "length", ("FIN",))
    assert replies[0].text == "Le café coûte 3 €. " and replies[0].finish_reason == "stop"


def test_the_last_reply_carries_usage_and_the_observer_sees_every_token(tokenizer):
    ids = tokenizer.encode("one two three four five").ids
    observer = RecordingObserver()
    stream, replies = run_stream(tokenizer, [ids[:1], ids[1:3], ids[3:]], "length", observer=observer)
    assert "".join(r.text for r in replies) == "one two three four five"
    assert [list(r.token_ids) for r in replies] == [ids[:1], ids[1:3], ids[3:]]
    assert [r.finish_reason for r in replies] == ["", "", "length"]
    assert not replies[1].HasField("usage")
    assert (replies[-1].usage.prompt_tokens, replies[-1].usage.completion_tokens) == (7, len(ids))
    assert observer.events == [
        ("first", "r1"), ("tokens", 2), ("tokens", len(ids) - 3), ("finished", 7, len(ids))
    ]


def test_a_stop_string_ends_the_stream_with_usage_so_far(tokenizer):
    ids = tokenizer.encode("alpha beta gamma").ids
    stream, replies = run_stream(tokenizer, [[i] for i in ids], "length", stop=(" beta",))
    assert "".join(r.text for r in replies) == "alpha"
    assert replies[-1].finish_reason == "stop" and stream.stopped
    assert replies[-1].usage.completion_tokens == len(replies)
    with pytest.raises(AssertionError):
        stream.reply([ids[-1]], "")


def test_a_first_token_that_finishes_is_one_reply(tokenizer):
    observer = RecordingObserver()
    _, replies = run_stream(tokenizer, [[2]], "stop", observer=observer)  # <|im_end|>: skipped
    assert [(r.text, r.finish_reason, r.usage.completion_tokens) for r in replies] == [("", "stop", 1)]
    assert observer.events == [("first", "r1"), ("finished", 7, 1)]
