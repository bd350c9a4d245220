"""Which replica (or worker) gets a request: the routing policies, as a plain class that needs
neither Ray nor HTTP. The Ray app's request router (ray/request_router.py) chooses among engine
replicas with it, the P/D proxy (proxy/workers.py) among the workers of a role, the simulator among
its replicas.

prefix-aware follows llm-d's approximate mode: the router does not ask replicas what they hold, it
remembers what it sent where. Each prompt becomes the chained block hashes of the engine's prefix
cache (block_manager.hash_block over the same block size), and the replica a prompt went to is
recorded as holding those blocks, in a per-replica LRU as large as that replica's KV cache. A new
request goes to the replica holding the longest run of its leading blocks; when no replica holds at
least `min_match_blocks`, or the best one has `max_imbalance` more requests in flight than the
least-loaded one, it goes to the least-loaded replica (ties: the one holding fewest blocks, so new
prefixes spread out, then in turn). What a replica evicted on its own is not seen, which costs a miss there, never
a wrong answer: the replica's own prefix cache checks every hit.

The prompt is the one the engine will get: PromptHasher renders a request body with the server's
own rendering (its tokenizer; for chat, ChatCompletionRequest.template_input, as the handler
calls it, and with --reasoning-parser gpt_oss harmony's rendering, not the template's), so a chat
that carries tool calls is hashed over the tokens the engine caches."""
import itertools
from collections import OrderedDict

from pdserve.engine.block_manager import hash_block
from pdserve.server import reasoning_parsers, tool_calls
from pdserve.server.protocol import ChatCompletionRequest

POLICIES = ("prefix-aware", "round-robin", "least-loaded")


def prompt_block_hashes(token_ids: list[int], block_size: int, salt: str | None = None) -> list[int]:
    """The chained hashes of the prompt's full blocks, short of its last token (as the engine's
    lookup: the last token is always computed)."""
    h, hashes = hash(("pdserve-router", salt)), []
    for i in range((len(token_ids) - 1) // block_size):
        h = hash_block(h, tuple(token_ids[i * block_size:(i + 1) * block_size]))
        hashes.append(h)
    return hashes


class PromptHasher:
    """A request body's prompt block hashes, rendered as the server renders it for the engine.
    reasoning_parser: the replicas' --reasoning-parser (gpt_oss renders chats with harmony)."""

    def __init__(self, tokenizer, block_size: int, reasoning_parser: str | None = None):
        self.tokenizer, self.block_size = tokenizer, block_size
        self.reasoning = reasoning_parsers.build(reasoning_parser, tokenizer) if reasoning_parser else None

    def __call__(self, path: str, body: dict) -> list[int]:
        """[] when the body is not one the router can read: the replica answers it with its precise 400."""
        try:
            if path == "/v1/chat/completions":
                req = ChatCompletionRequest.model_validate(body)
                messages, template_vars = req.template_input(tool_calls.offered(req))
                if self.reasoning is not None and self.reasoning.harmony:
                    ids = self.reasoning.render(messages, template_vars.get("tools", []), req.reasoning_effort)
                else:
                    ids = self.tokenizer.encode_chat(messages, add_generation_prompt=True, **template_vars)
            elif path == "/v1/completions":
                prompt = body["prompt"]
                if isinstance(prompt, list) and prompt and not isinstance(prompt[0], int):
                    prompt = prompt[0]   # a batch: routed by its first prompt
                ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
            else:
                return []
            return prompt_block_hashes(ids, self.block_size, body.get("cache_salt"))
        except Exception:   # malformed
            return []


class Router:
    def __init__(self, policy: str = "prefix-aware", capacity_blocks: int = 1 << 16, min_match_blocks: int = 1,
                 max_imbalance: int = 8):
        if policy not in POLICIES:
            raise ValueError(f"routing policy must be one of {', '.join(POLICIES)}, got {policy!r}")
        self.policy = policy
        self.capacity_blocks = capacity_blocks    # per replica: its KV cache
        self.min_match_blocks = min_match_blocks
        self.max_imbalance = max_imbalance
        self.held: dict = {}                       # replica -> OrderedDict of block hashes, least recent first
        self.in_flight: dict = {}                  # replica -> requests sent and not completed
        self._turn = itertools.count()

    def choose(self, replicas: list, hashes: list[int] = ()) -> tuple:
        """(the replica for a request whose prompt has these block hashes, the blocks it holds).
        `replicas`: the live ones, in a stable order."""
        if not replicas:
            raise ValueError("no replicas to route to")
        if self.policy == "round-robin":
            return replicas[next(self._turn) % len(replicas)], 0
        load = {r: self.in_flight.get(r, 0) for r in replicas}
        start = next(self._turn) % len(replicas)   # ties go round in turn
        least = min(replicas[start:] + replicas[:start], key=lambda r: (load[r], len(self.held.get(r, ()))))
        if self.policy == "least-loaded":
            return least, 0
        best, matched = least, 0
        for r in replicas:
            n = self.matched_blocks(r, hashes)
            if n > matched or (n == matched and n and load[r] < load[best]):
                best, matched = r, n
        if matched < self.min_match_blocks or load[best] - load[least] > self.max_imbalance:
            return least, self.matched_blocks(least, hashes)
        return best, matched

    def matched_blocks(self, replica, hashes: list[int]) -> int:
        held, n = self.held.get(replica, {}), 0
        for h in hashes:
            if h not in held:
                break
            n += 1
        return n

    def record(self, replica, hashes: list[int], capacity_blocks: int | None = None) -> None:
        """`replica` was sent a prompt with these blocks: it holds them now, most recently used.
        capacity_blocks: that replica's KV cache, when it reported it (else the router's default)."""
        held = self.held.setdefault(replica, OrderedDict())
        for h in hashes:
            held[h] = None
            held.move_to_end(h)
        while len(held) > (capacity_blocks or self.capacity_blocks):
            held.popitem(last=False)

    def sent(self, replica) -> None:
        self.in_flight[replica] = self.in_flight.get(replica, 0) + 1

    def completed(self, replica) -> None:
        if self.in_flight.get(replica, 0) > 0:
            self.in_flight[replica] -= 1

    def remove(self, replica) -> None:
        """A replica died or was scaled away: forget what it held."""
        self.held.pop(replica, None)
        self.in_flight.pop(replica, None)

    def keep_only(self, replicas) -> None:
        for r in set(self.held) | set(self.in_flight):
            if r not in replicas:
                self.remove(r)
