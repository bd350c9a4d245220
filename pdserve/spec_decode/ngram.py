"""N-gram prompt lookup: no extra model. The last n tokens of a sequence (prompt and output so
far) are looked for earlier in it, longest n first; the tokens that followed the latest earlier
occurrence are the drafts. Pays off where the output repeats its input (editing, summarizing,
code), and costs nothing where nothing matches (no drafts, a plain decode)."""
from array import array

from pdserve.spec_decode.config import SpeculativeConfig


def propose(token_ids: list[int], k: int, n_min: int, n_max: int) -> list[int]:
    """Up to k drafts for what follows token_ids; [] if no tail of n_min..n_max tokens recurs."""
    L = len(token_ids)
    if L < n_min + 1 or k < 1:
        return []
    # bytes.rfind does the search in C; a hit must start on a token boundary (offsets of 4)
    data = array("I", token_ids).tobytes()
    for n in range(min(n_max, L - 1), n_min - 1, -1):
        tail = data[4 * (L - n):]
        end = 4 * (L - 1)   # an occurrence must end before the tail's last token: something follows it
        while True:
            i = data.rfind(tail, 0, end)
            if i < 0:
                break
            if i % 4 == 0:
                start = i // 4 + n
                return token_ids[start:start + k]
            end = i + len(tail) - 1
    return []


class NgramProposer:
    def __init__(self, config: SpeculativeConfig):
        self.n_min, self.n_max = config.prompt_lookup_min, config.prompt_lookup_max

    def propose(self, seqs, num_drafts: list[int]) -> list[list[int]]:
        return [propose(s.token_ids, k, self.n_min, self.n_max) for s, k in zip(seqs, num_drafts)]

    def rollback(self, seq) -> None:   # nothing cached: the lookup reads the tokens each step
        pass
