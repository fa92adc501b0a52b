"""What a benchmark sends: request specs with exact prompt token ids and output lengths.

Every workload is an endless, deterministic iterator of `RequestSpec`s driven by one
`random.Random(seed)`: the same seed yields the same requests on every machine, so two
systems compared under one seed see identical prompts and output lengths. Synthetic
prompt *content* comes from a second generator (`content_seed`, default: `seed`), so a
sweep can replay the same lengths and arrivals at every rate with fresh token ids: replayed
prompts would hit the server's prefix cache and make every rate after the first cheaper. Synthetic
prompts are random token ids in [100, 40000): below the vocabulary of the models served
here and above the special tokens, so no id ends or templates a prompt by accident.

Kinds:
- ``random``        prompt and output lengths uniform in inclusive ranges.
- ``classmix``      interactive / batch / offline classes, each with its own priority,
                    length ranges and share of the traffic.
- ``shared-prefix`` N groups; every request of a group starts with the group's long
                    prefix and continues with its own random suffix (prefix caching).
- ``sharegpt``      a ShareGPT-style JSON file: first human turn as the prompt, the gpt
                    turn's token length as the output length.
"""

from __future__ import annotations

import itertools
import json
import random
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

TOKEN_ID_LOW = 100
TOKEN_ID_HIGH = 40000  # exclusive
WORKLOAD_KINDS = ("random", "classmix", "shared-prefix", "sharegpt")


@dataclass(slots=True, frozen=True)
class LengthRange:
    """An inclusive range of token counts, written ``LOW:HIGH`` on the command line."""

    low: int
    high: int

    def __post_init__(self) -> None:
        if not 1 <= self.low <= self.high:
            raise ValueError(f"need 1 <= low <= high, got {self.low}:{self.high}")

    @classmethod
    def parse(cls, text: str) -> LengthRange:
        low, sep, high = text.partition(":")
        try:
            return cls(int(low), int(high if sep else low))
        except ValueError as e:
            raise ValueError(f"bad length range {text!r}: want LOW:HIGH, e.g. 64:1536") from e

    def sample(self, rng: random.Random) -> int:
        return rng.randint(self.low, self.high)

    @property
    def mean(self) -> float:
        return (self.low + self.high) / 2


@dataclass(slots=True, frozen=True)
class RequestSpec:
    request_id: str
    prompt_token_ids: tuple[int, ...]
    output_len: int
    class_name: str = "default"
    # Lower is more urgent (vLLM's convention); sent only where the API has the field.
    priority: int = 0

    @property
    def prompt_len(self) -> int:
        return len(self.prompt_token_ids)


@dataclass(slots=True, frozen=True)
class RequestClass:
    name: str
    priority: int
    weight: float
    input_len: LengthRange
    output_len: LengthRange


def default_classes() -> list[RequestClass]:
    """Chat-like interactive traffic, document-sized batch jobs and long offline work."""
    return [
        RequestClass("interactive", 0, 0.5, LengthRange(64, 512), LengthRange(32, 128)),
        RequestClass("batch", 1, 0.3, LengthRange(256, 1536), LengthRange(64, 256)),
        RequestClass("offline", 2, 0.2, LengthRange(512, 1536), LengthRange(128, 256)),
    ]


def parse_class_mix(text: str, base: list[RequestClass] | None = None) -> list[RequestClass]:
    """``interactive=0.6,batch=0.4``: reweights (and selects) the classes of `base`
    (default: `default_classes()`)."""
    by_name = {c.name: c for c in (base or default_classes())}
    classes = []
    for item in filter(None, (part.strip() for part in text.split(","))):
        name, _, weight = item.partition("=")
        if name not in by_name:
            raise ValueError(f"unknown class {name!r}; known: {', '.join(by_name)}")
        c = by_name[name]
        classes.append(RequestClass(c.name, c.priority, float(weight or 1.0),
                                    c.input_len, c.output_len))
    if not classes or sum(c.weight for c in classes) <= 0:
        raise ValueError(f"class mix {text!r} has no positive weight")
    return classes


@dataclass(slots=True)
class WorkloadConfig:
    kind: str = "random"
    input_len: LengthRange = field(default_factory=lambda: LengthRange(64, 1536))
    output_len: LengthRange = field(default_factory=lambda: LengthRange(32, 256))
    classes: list[RequestClass] = field(default_factory=default_classes)
    num_prefix_groups: int = 4
    prefix_len: int = 1024
    suffix_len: LengthRange = field(default_factory=lambda: LengthRange(32, 256))
    dataset: Path | None = None
    # Model folder whose tokenizer measures ShareGPT prompts and outputs.
    tokenizer_path: Path | None = None
    # ShareGPT pairs longer than this (prompt + output) are skipped.
    max_model_len: int = 4096

    def __post_init__(self) -> None:
        if self.kind not in WORKLOAD_KINDS:
            raise ValueError(f"workload {self.kind!r}: want one of {', '.join(WORKLOAD_KINDS)}")
        if self.kind == "sharegpt" and (self.dataset is None or self.tokenizer_path is None):
            raise ValueError("the sharegpt workload needs --dataset and a model (tokenizer)")
        if self.num_prefix_groups < 1 or self.prefix_len < 1:
            raise ValueError("shared-prefix needs >= 1 group and a prefix of >= 1 token")


def random_token_ids(rng: random.Random, n: int) -> tuple[int, ...]:
    return tuple(rng.randrange(TOKEN_ID_LOW, TOKEN_ID_HIGH) for _ in range(n))


def random_requests(rng: random.Random, content: random.Random, input_len: LengthRange,
                    output_len: LengthRange, id_prefix: str) -> Iterator[RequestSpec]:
    for i in itertools.count():
        prompt = random_token_ids(content, input_len.sample(rng))
        yield RequestSpec(f"{id_prefix}{i}", prompt, output_len.sample(rng))


def classmix_requests(rng: random.Random, content: random.Random, classes: list[RequestClass],
                      id_prefix: str) -> Iterator[RequestSpec]:
    weights = [c.weight for c in classes]
    for i in itertools.count():
        c = rng.choices(classes, weights=weights)[0]
        prompt = random_token_ids(content, c.input_len.sample(rng))
        yield RequestSpec(f"{id_prefix}{i}", prompt, c.output_len.sample(rng), c.name,
                          c.priority)


def quantile_lengths(lengths: LengthRange, n: int) -> list[int]:
    """``n`` lengths at the middles of ``n`` equal shares of the range: its quantiles
    (i + 0.5) / n, in increasing order; their median is the range's median."""
    span = lengths.high - lengths.low
    return [lengths.low + round(span * (i + 0.5) / n) for i in range(n)]


def stratified_requests(cfg: WorkloadConfig, n: int, seed: int, id_prefix: str,
                        content_seed: int | None = None) -> list[RequestSpec] | None:
    """``n`` requests whose prompt and output lengths are the workload's length quantiles
    (`quantile_lengths`), outputs paired with prompts in an order ``seed`` shuffles, token
    ids from ``content_seed`` (default ``seed``); None
    for a workload that is not one range of lengths (shared-prefix, sharegpt, several
    classes), which is drawn at random instead.

    A compare's SLOs are the p50s of its unloaded run. Eight random draws put them
    wherever the draws fell: with the default seed, long's eight prompts had a median of
    1,741 tokens against the workload's 1,280, short's 54 against 40, and the offline
    class's 882 against 1,280, so each TTFT objective stood for other prompts than the
    workload's."""
    if cfg.kind == "random":
        name, priority, input_len, output_len = "default", 0, cfg.input_len, cfg.output_len
    elif cfg.kind == "classmix" and len(cfg.classes) == 1:
        (c,) = cfg.classes
        name, priority, input_len, output_len = c.name, c.priority, c.input_len, c.output_len
    else:
        return None
    rng = random.Random(seed)
    content = random.Random(f"content-{seed if content_seed is None else content_seed}")
    outputs = quantile_lengths(output_len, n)
    rng.shuffle(outputs)
    return [RequestSpec(f"{id_prefix}{i}", random_token_ids(content, prompt_len), out, name, priority)
            for i, (prompt_len, out) in enumerate(zip(quantile_lengths(input_len, n), outputs))]


def shared_prefix_requests(rng: random.Random, content: random.Random, cfg: WorkloadConfig,
                           id_prefix: str) -> Iterator[RequestSpec]:
    prefixes = [random_token_ids(content, cfg.prefix_len) for _ in range(cfg.num_prefix_groups)]
    for i in itertools.count():
        group = rng.randrange(cfg.num_prefix_groups)
        prompt = prefixes[group] + random_token_ids(content, cfg.suffix_len.sample(rng))
        yield RequestSpec(f"{id_prefix}{i}", prompt, cfg.output_len.sample(rng),
                          f"group{group}")


def load_sharegpt_pairs(path: Path, tokenize: Callable[[str], list[int]],
                        max_model_len: int) -> list[tuple[tuple[int, ...], int]]:
    """(prompt token ids, output length) for each usable conversation, in file order.

    Like vLLM's benchmark, pairs with fewer than 4 prompt or output tokens are skipped
    (they measure little but overhead), and so are pairs that do not fit the context.
    """
    pairs = []
    for entry in json.loads(Path(path).read_text()):
        turns = entry.get("conversations", [])
        human = next((t["value"] for t in turns if t.get("from") == "human"), None)
        gpt = next((t["value"] for t in turns if t.get("from") == "gpt"), None)
        if human is None or gpt is None:
            continue
        prompt_ids, output_len = tuple(tokenize(human)), len(tokenize(gpt))
        if len(prompt_ids) < 4 or output_len < 4:
            continue
        if len(prompt_ids) + output_len > max_model_len:
            continue
        pairs.append((prompt_ids, output_len))
    if not pairs:
        raise ValueError(f"{path}: no usable conversations (human + gpt turns)")
    return pairs


def sharegpt_requests(rng: random.Random, pairs: list[tuple[tuple[int, ...], int]],
                      id_prefix: str) -> Iterator[RequestSpec]:
    """The pairs in a seeded order, reshuffled each time the file runs out."""
    counter = itertools.count()
    while True:
        order = list(range(len(pairs)))
        rng.shuffle(order)
        for k in order:
            prompt, output_len = pairs[k]
            yield RequestSpec(f"{id_prefix}{next(counter)}", prompt, output_len)


def hf_tokenize(model_path: Path) -> Callable[[str], list[int]]:
    """The model folder's tokenizer, without special tokens (the server adds its own)."""
    from transformers import AutoTokenizer  # heavy; only the sharegpt workload needs it

    tokenizer = AutoTokenizer.from_pretrained(str(model_path))
    return lambda text: tokenizer.encode(text, add_special_tokens=False)


def build_workload(cfg: WorkloadConfig, seed: int, id_prefix: str = "req-",
                   tokenize: Callable[[str], list[int]] | None = None,
                   content_seed: int | None = None) -> Iterator[RequestSpec]:
    """`seed` fixes classes and lengths; `content_seed` (default `seed`) the synthetic
    prompts' token ids. ShareGPT prompts are the file's text and ignore it."""
    rng = random.Random(seed)
    content = random.Random(f"content-{seed if content_seed is None else content_seed}")
    if cfg.kind == "random":
        return random_requests(rng, content, cfg.input_len, cfg.output_len, id_prefix)
    if cfg.kind == "classmix":
        return classmix_requests(rng, content, cfg.classes, id_prefix)
    if cfg.kind == "shared-prefix":
        return shared_prefix_requests(rng, content, cfg, id_prefix)
    assert cfg.dataset is not None and cfg.tokenizer_path is not None  # __post_init__
    pairs = load_sharegpt_pairs(cfg.dataset, tokenize or hf_tokenize(cfg.tokenizer_path),
                                cfg.max_model_len)
    return sharegpt_requests(rng, pairs, id_prefix)


def take(requests: Iterator[RequestSpec], n: int) -> list[RequestSpec]:
    return list(itertools.islice(requests, n))
