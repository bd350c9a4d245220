"""Where the prompts of `pdserve bench` come from.

Generated prompts are lists of token ids, which vLLM, llama-server and pdserve all accept in
/v1/completions, so a prompt is exactly as long as asked with no tokenizer on the client. The
ids are drawn from a pool: the distinct ids the server's own /tokenize gives for a piece of
the bundled story corpus (always valid, no special tokens), or `range(--vocab-size)` for a
server without /tokenize. Draws are seeded (`seed` is anything numpy's default_rng takes), so
a `--seed` gives the same prompts on every server, and a new seed gives fresh ones: servers
cache prefixes, and a rerun with the same seed would measure cache hits.
"""
import contextlib
import json
import math
import os
from dataclasses import dataclass

import httpx
import numpy as np

# the first 20,000 characters of the story corpus (tools/corpus/stories.txt)
POOL_TEXT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data", "stories.txt")
POOL_TEXT_CHARS = 20000   # enough text for a few thousand distinct ids on a 150k vocabulary
DIALOGUES = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data", "dialogues.jsonl")
DATASETS = ("random", "shared-prefix", "long-short", "multi-turn", "edit")
EDIT_INSTRUCTION = "Copy out the story above again, fixing any mistakes:"



@dataclass
class BenchRequest:
    prompt: str | list[int]
    prompt_len: int | None   # None for a text prompt: only the server knows
    output_len: int
    kind: str | None = None  # a label the report splits by (long-short: "long" / "short")


def fetch_token_pool(base_url: str, headers: dict | None = None, client: httpx.Client | None = None) -> list[int]:
    """Distinct token ids of corpus text, from the server's /tokenize.

    vLLM and pdserve take `{"prompt": ...}`, llama-server `{"content": ...}`; each ignores the
    other's field, so we try both and keep the first answer with tokens in it.
    """
    with open(POOL_TEXT, encoding="utf-8") as f:
        text = f.read(POOL_TEXT_CHARS)
    problems = []
    with contextlib.nullcontext(client) if client else httpx.Client(timeout=60) as c:
        for body in ({"prompt": text, "add_special_tokens": False}, {"content": text, "add_special": False}):
            try:
                r = c.post(base_url + "/tokenize", json=body, headers=headers)
                tokens = r.json().get("tokens") if r.status_code == 200 else None
                if tokens:   # llama-server may give {"id", "piece"} objects
                    return sorted({t if isinstance(t, int) else t["id"] for t in tokens})
                problems.append(f"HTTP {r.status_code}: {r.text[:200]}")
            except (httpx.HTTPError, ValueError, AttributeError, KeyError, TypeError) as e:
                problems.append(f"{type(e).__name__}: {e}")
    raise RuntimeError(f"{base_url}/tokenize gave no tokens ({'; '.join(problems)}); "
                       "pass --vocab-size N to draw prompt ids from range(N) instead")


def sample_lengths(rng: np.random.Generator, n: int, mean: int, range_ratio: float, low: int = 0) -> list[int]:
    """n lengths uniform on [floor(mean*(1-r)), ceil(mean*(1+r))] (vLLM's --random-range-ratio)."""
    if not 0 <= range_ratio < 1:
        raise ValueError(f"--random-range-ratio must be in [0, 1), got {range_ratio}")
    lo = max(low, math.floor(mean * (1 - range_ratio)))
    hi = max(lo, math.ceil(mean * (1 + range_ratio)))
    return rng.integers(lo, hi + 1, size=n).tolist()


def _ids(rng: np.random.Generator, pool: np.ndarray, n: int) -> list[int]:
    return pool[rng.integers(0, len(pool), size=n)].tolist()


def random_requests(pool: list[int], n: int, input_len: int, output_len: int, range_ratio: float,
                    seed) -> list[BenchRequest]:
    rng, ids = np.random.default_rng(seed), np.asarray(pool)
    ins = sample_lengths(rng, n, input_len, range_ratio, low=1)
    outs = sample_lengths(rng, n, output_len, range_ratio, low=1)
    return [BenchRequest(_ids(rng, ids, i), i, o) for i, o in zip(ins, outs)]


def shared_prefix_requests(pool: list[int], n: int, num_groups: int, prefix_len: int, suffix_len: int,
                           output_len: int, range_ratio: float, seed) -> list[BenchRequest]:
    """`num_groups` system prompts of `prefix_len` ids; each request is one of them plus its own
    suffix. The groups are interleaved in a shuffled order, so each prefix is reused while the
    others compete with it for the cache."""
    rng, ids = np.random.default_rng(seed), np.asarray(pool)
    prefixes = [_ids(rng, ids, prefix_len) for _ in range(num_groups)]
    groups = rng.permutation([i % num_groups for i in range(n)]).tolist()
    ins = sample_lengths(rng, n, suffix_len, range_ratio, low=1)
    outs = sample_lengths(rng, n, output_len, range_ratio, low=1)
    return [BenchRequest(prefixes[g] + _ids(rng, ids, s), prefix_len + s, o) for g, s, o in zip(groups, ins, outs)]


def long_short_requests(pool: list[int], n: int, short_len: int, long_len: int, output_len: int,
                        long_fraction: float, range_ratio: float, seed) -> list[BenchRequest]:
    """Mostly short prompts with a few long ones spread evenly through the arrival order: the
    head-of-line case, where a long prefill can stall the decodes of the short requests."""
    if not 0 < long_fraction < 1:
        raise ValueError(f"--long-fraction must be in (0, 1), got {long_fraction}")
    rng, ids = np.random.default_rng(seed), np.asarray(pool)
    num_long = max(1, round(n * long_fraction))
    long_at = {int((k + 0.5) * n / num_long) for k in range(num_long)}
    outs = sample_lengths(rng, n, output_len, range_ratio, low=1)
    shorts = sample_lengths(rng, n, short_len, range_ratio, low=1)
    reqs = []
    for i in range(n):
        length, kind = (long_len, "long") if i in long_at else (shorts[i], "short")
        reqs.append(BenchRequest(_ids(rng, ids, length), length, outs[i], kind))
    return reqs


def multi_turn_conversations(n: int, num_turns: int, seed, passage_words: int = 0) -> list[list[str]]:
    """n conversations of num_turns user messages each, the questions of the bundled dialogues
    corpus drawn at random (the answers are the server's own, sent back as the history grows).
    With passage_words, each message first quotes that many consecutive words of the story corpus
    (a user chatting about documents): the history then grows by the messages themselves, also
    with a model whose answers are short or empty."""
    if num_turns < 1:
        raise ValueError(f"--num-turns must be at least 1, got {num_turns}")
    if passage_words < 0:
        raise ValueError(f"--turn-passage-words must be >= 0, got {passage_words}")
    with open(DIALOGUES, encoding="utf-8") as f:
        questions = [json.loads(line)[0]["content"] for line in f if line.strip()]
    words = []
    if passage_words:
        with open(POOL_TEXT, encoding="utf-8") as f:
            words = f.read().split()
        if len(words) <= passage_words:
            raise ValueError(f"--turn-passage-words {passage_words}: the corpus has {len(words)} words")
    rng = np.random.default_rng(seed)
    convs = [[questions[i] for i in rng.integers(0, len(questions), size=num_turns)] for _ in range(n)]
    if passage_words:   # drawn after the questions: the same seed asks the same questions either way
        for turns in convs:
            for k, question in enumerate(turns):
                at = int(rng.integers(0, len(words) - passage_words))
                turns[k] = " ".join(words[at:at + passage_words]) + "\n\n" + question
    return convs


def edit_requests(n: int, output_len: int, seed) -> list[BenchRequest]:
    """Text prompts holding a story of the bundled corpus, an instruction to write it out again
    and its first sentence: an answer that follows the instruction repeats the prompt (what
    speculative decoding's n-gram lookup is for). Stories drawn at random, each cut to about
    output_len words so the answer has text to repeat."""
    with open(POOL_TEXT, encoding="utf-8") as f:
        stories = [s.strip() for s in f.read().split("\n\n") if s.strip()]
    rng = np.random.default_rng(seed)
    reqs = []
    for i in rng.integers(0, len(stories), size=n):
        story = " ".join(stories[i].split()[:max(8, output_len)])
        first = story.split(". ")[0] + "."
        reqs.append(BenchRequest(f"{story}\n\n{EDIT_INSTRUCTION}\n\n{first}", None, output_len))
    return reqs


def file_requests(path: str, n: int | None, default_output_len: int) -> list[BenchRequest]:
    """The first n lines of a JSONL file of {"prompt": text or token ids, "max_tokens"?: int}."""
    reqs = []
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
                prompt = row["prompt"]
                out = int(row.get("max_tokens", default_output_len))
            except (ValueError, KeyError, TypeError, AttributeError) as e:
                raise ValueError(f"{path}:{lineno}: expected {{\"prompt\": ..., \"max_tokens\"?: N}} ({e})") from None
            ok = isinstance(prompt, str) or (isinstance(prompt, list) and all(isinstance(t, int) for t in prompt))
            if not ok:
                raise ValueError(f"{path}:{lineno}: prompt must be a string or a list of token ids")
            reqs.append(BenchRequest(prompt, None if isinstance(prompt, str) else len(prompt), out))
    if not reqs:
        raise ValueError(f"{path} has no prompts")
    if n is not None and n > len(reqs):
        raise ValueError(f"{path} has {len(reqs)} prompts, --num-prompts asked for {n}")
    return reqs if n is None else reqs[:n]


def add_dataset_arguments(parser) -> None:
    g = parser.add_argument_group("dataset")
    g.add_argument("--dataset-name", "--dataset", default="random", choices=DATASETS,
                   help="generated prompts (token ids): random lengths; groups sharing a system prompt; "
                        "a few long prompts among short ones; or multi-turn chats (/v1/chat/completions, "
                        "each turn sent when the previous answer arrived, history growing; --num-prompts "
                        "counts conversations); or edit: text prompts holding a story the answer is asked to "
                        "repeat, where speculative decoding's n-gram lookup hits (default: %(default)s)")
    g.add_argument("--dataset-path", default=None, metavar="FILE.jsonl",
                   help='prompts from a file instead, one {"prompt": text or token ids, "max_tokens"?: N} '
                        "per line, sent in file order")
    g.add_argument("--num-prompts", type=int, default=None,
                   help="requests to send (default: 100, or every line of --dataset-path)")
    g.add_argument("--random-input-len", type=int, default=256,
                   help="prompt tokens per request; for shared-prefix the part after the shared prefix, "
                        "for long-short the short prompts (default: %(default)s)")
    g.add_argument("--random-output-len", type=int, default=128,
                   help="max_tokens per request, also for file lines without one (default: %(default)s)")
    g.add_argument("--random-range-ratio", type=float, default=0.0,
                   help="draw lengths uniformly from [len*(1-r), len*(1+r)], r in [0, 1) (default: %(default)s)")
    g.add_argument("--prefix-len", type=int, default=512,
                   help="shared-prefix: tokens of each group's shared system prompt (default: %(default)s)")
    g.add_argument("--num-prefix-groups", type=int, default=4,
                   help="shared-prefix: how many distinct shared prompts (default: %(default)s)")
    g.add_argument("--num-turns", type=int, default=5,
                   help="multi-turn: user turns per conversation; each answer is --random-output-len tokens "
                        "(default: %(default)s)")
    g.add_argument("--turn-passage-words", type=int, default=0,
                   help="multi-turn: words of story text quoted before each user question, so the history "
                        "grows also when the answers are short (default: %(default)s)")
    g.add_argument("--long-input-len", type=int, default=768,
                   help="long-short: prompt tokens of the long requests (default: %(default)s)")
    g.add_argument("--long-fraction", type=float, default=0.1,
                   help="long-short: fraction of requests that are long, at least one (default: %(default)s)")
    g.add_argument("--vocab-size", type=int, default=None,
                   help="draw prompt ids from range(N) instead of asking the server's /tokenize")


def make_requests(args, n: int | None, seed, pool: list[int] | None) -> list[BenchRequest]:
    """The requests `args` ask for; `pool` is needed by the generated datasets only."""
    if args.dataset_path:
        return file_requests(args.dataset_path, n, args.random_output_len)
    n = 100 if n is None else n
    if args.dataset_name == "edit":
        return edit_requests(n, args.random_output_len, seed)
    if args.dataset_name == "random":
        return random_requests(pool, n, args.random_input_len, args.random_output_len, args.random_range_ratio, seed)
    if args.dataset_name == "shared-prefix":
        return shared_prefix_requests(pool, n, args.num_prefix_groups, args.prefix_len, args.random_input_len,
                                      args.random_output_len, args.random_range_ratio, seed)
    return long_short_requests(pool, n, args.random_input_len, args.long_input_len, args.random_output_len,
                               args.long_fraction, args.random_range_ratio, seed)
