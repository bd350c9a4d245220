"""A small draft model of the target's tokenizer proposes greedily, k tokens one forward each.

The draft runs on its own ModelRunner (weights packed as the target's are, its own KV cache) whose
cache has the target's block count and is indexed by the target's block tables and slots: a
sequence's draft K/V lives at the same slots as its target K/V, so the target's rollback (slots
past num_computed_tokens are stale) is the draft's too. DraftState.computed counts the
tokens whose draft K/V is in place; each proposal first catches up on the rest (the prompt at the
first proposal; the bonus token, and the last draft when all were accepted, afterwards), as one
chunk, then decodes k - 1 more. Greedy drafts make q one-hot, so the rejection sampler keeps the
target's distribution (rejection.py). Draft K/V is written to blocks other sequences may share
through the prefix cache: same tokens at the same positions, so the same values."""
import dataclasses

import torch

from pdserve.config import EngineConfig, ModelConfig
from pdserve.errors import ConfigError


class DraftModelProposer:
    def __init__(self, model_dir: str, target_config: EngineConfig, target_model: ModelConfig, num_blocks: int,
                 max_model_len: int, eos_token_ids: list[int]):
        from pdserve.engine.model_runner import ModelRunner   # here: the runner imports the engine's modules
        draft = ModelConfig.from_dir(model_dir)
        if draft.vocab_size > target_model.vocab_size:
            raise ConfigError(f"speculative model {model_dir}: vocab_size {draft.vocab_size} is larger than the "
                              f"target's {target_model.vocab_size} (a draft model shares the target's tokenizer)")
        if draft.max_position_embeddings < max_model_len:
            raise ConfigError(f"speculative model {model_dir}: max_position_embeddings "
                              f"{draft.max_position_embeddings} is below max_model_len {max_model_len}")
        config = dataclasses.replace(target_config, model=model_dir, num_kv_blocks=num_blocks, kv_cache_memory=None,
                                     num_speculative_tokens=0, speculative_model=None, speculative_config=None)
        self.runner = ModelRunner(draft, config, max_model_len, eos_token_ids)
        self.block_size = config.block_size

    def propose(self, seqs, num_drafts: list[int]) -> list[list[int]]:
        """num_drafts[i] greedy drafts for each of seqs, whose block tables cover them already."""
        drafts = [[] for _ in seqs]
        live = [i for i, k in enumerate(num_drafts) if k > 0]
        # first forward: each sequence's tokens not yet in the draft cache, up to its last token
        rows = []
        for i in live:
            s = seqs[i]
            s.draft.computed = first = min(s.draft.computed, s.num_tokens - 1)
            rows.append((s.token_ids[first:], first, s))
        while rows:
            for i, (tokens, _, seq), t in zip(live, rows, self._next_tokens(rows)):
                drafts[i].append(t)
                seq.draft.computed += len(tokens)
            live = [i for i in live if len(drafts[i]) < num_drafts[i]]
            rows = [([drafts[i][-1]], seqs[i].num_tokens + len(drafts[i]) - 1, seqs[i]) for i in live]
        return drafts

    @torch.inference_mode()
    def _next_tokens(self, rows) -> list[int]:
        """One draft forward over (tokens, first position, seq) rows; each row's next greedy token."""
        r, bs = self.runner, self.block_size
        ids, positions, slots, last = [], [], [], []
        groups = {True: ([], [], [], []), False: ([], [], [], [])}
        for tokens, first, seq in rows:
            n, table = len(tokens), seq.block_table
            g = groups[n == 1]
            g[0].append(n)
            g[1].append(len(ids))
            g[2].append(first + n)
            g[3].append(table)
            ids += tokens
            pos = range(first, first + n)
            positions += pos
            slots += [table[p // bs] * bs + p % bs for p in pos]
            last.append(len(ids) - 1)
        (ids_t, pos_t, _), meta = r.backend.build_metadata([ids, positions, slots], [g for g in groups.values() if g[0]],
                                                           bs, r.device)
        hidden = r.backend.forward(r.model, ids_t, pos_t, meta)[last]
        if r.backend.fused_argmax and hidden.dtype == torch.float32:
            return r.backend.argmax(r.model, hidden).tolist()
        return r.backend.compute_logits(r.model, hidden).float().argmax(dim=-1).tolist()
