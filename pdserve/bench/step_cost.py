"""What one engine step costs, counted from the model config: FLOPs (linears, attention, lm_head)
and bytes moved (weights, KV read and written). `pdserve roofline` sets these beside measured
step times; the ratio of the two is each step's arithmetic intensity."""
from dataclasses import dataclass

from pdserve.config import ModelConfig


@dataclass(frozen=True)
class ModelCost:
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    body_matmul_params: int   # linear weights of the decoder (each used once by every token)
    body_other_params: int    # norms and biases: read once per forward, next to no FLOPs
    lm_head_params: int       # used once per row that gets logits
    embed_row_params: int     # gathered per token (token embedding; OPT's learned position too)
    sliding_window: int | None
    itemsize: int                 # bytes per activation, KV element and non-matmul weight
    weight_itemsize: float = 0.0  # bytes per linear (and lm_head) weight, if not itemsize: int8 = 1

    @classmethod
    def from_config(cls, m: ModelConfig, itemsize: int, weight_itemsize: float = 0.0) -> "ModelCost":
        h, H, Hkv, D, I, L = (m.hidden_size, m.num_heads, m.num_kv_heads, m.head_dim, m.intermediate_size,
                              m.num_layers)
        raw = m.raw
        if m.architecture == "OPTForCausalLM":
            proj = raw.get("word_embed_proj_dim") or h
            bias = raw.get("enable_bias", True)
            affine = raw.get("layer_norm_elementwise_affine", True)
            final_ln = raw.get("do_layer_norm_before", True) and not raw.get("_remove_final_layer_norm", False)
            matmul = L * (4 * h * h + 2 * h * I) + (2 * proj * h if proj != h else 0)
            other = L * ((5 * h + I if bias else 0) + (4 * h if affine else 0)) + (2 * h if final_ln and affine else 0)
            return cls(L, H, H, D, matmul, other, proj * m.vocab_size, proj + h, None, itemsize, weight_itemsize)
        qwen2 = m.architecture == "Qwen2ForCausalLM"
        qkv_bias = qwen2 or raw.get("attention_bias", False)
        o_bias = not qwen2 and raw.get("attention_bias", False)
        matmul = L * (2 * h * H * D + 2 * h * Hkv * D + 3 * h * I)
        biases = (H * D + 2 * Hkv * D if qkv_bias else 0) + (h if o_bias else 0) + \
                 (2 * I + h if raw.get("mlp_bias", False) else 0)
        other = L * (2 * h + biases) + h
        return cls(L, H, Hkv, D, matmul, other, h * m.vocab_size, h, m.sliding_window, itemsize, weight_itemsize)

    @property
    def kv_bytes_per_token(self) -> int:
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * self.itemsize


@dataclass
class StepCost:
    flops_linear: int
    flops_attn: int
    flops_lm_head: int
    bytes_weights: int
    bytes_kv_read: int
    bytes_kv_write: int

    @property
    def flops(self) -> int:
        return self.flops_linear + self.flops_attn + self.flops_lm_head

    @property
    def bytes(self) -> int:
        return self.bytes_weights + self.bytes_kv_read + self.bytes_kv_write


def step_cost(m: ModelCost, seqs: list[tuple[int, int]], logit_rows: int) -> StepCost:
    """Cost of one forward over `seqs`, each (new tokens, context after the step), with logits
    for `logit_rows` rows. Attention counts the causal (useful) work: a query at position p scores
    and sums min(p + 1, window) keys. Bytes are the least a forward must move: every weight once
    (embedding rows per token, the lm_head only if some row gets logits), each sequence's K/V once,
    the new K/V written; activations are not counted."""
    T = sum(q for q, _ in seqs)
    keys = kv_tokens = 0
    for q, c in seqs:
        w = m.sliding_window or c
        keys += sum(min(p + 1, w) for p in range(c - q, c))
        kv_tokens += min(c, q + w - 1)   # the keys any of its queries sees, each read once
    matmul = m.body_matmul_params + (m.lm_head_params if logit_rows else 0)
    return StepCost(
        flops_linear=2 * m.body_matmul_params * T,
        flops_attn=4 * m.num_layers * m.num_heads * m.head_dim * keys,   # QK^T and PV, 2 FLOPs per MAC
        flops_lm_head=2 * m.lm_head_params * logit_rows,
        bytes_weights=matmul * (m.weight_itemsize or m.itemsize) + (m.body_other_params + m.embed_row_params * T) * m.itemsize,
        bytes_kv_read=kv_tokens * m.kv_bytes_per_token,
        bytes_kv_write=T * m.kv_bytes_per_token)


def phase_steps(phase: str, batch: int, context: int) -> tuple[list[tuple[int, int]], int]:
    """The sequences of one measured step and how many get logits."""
    if phase == "decode":
        return [(1, context)] * batch, batch
    return [(context, context)], 1   # prefill, and nocache: one token by re-running the whole sequence
