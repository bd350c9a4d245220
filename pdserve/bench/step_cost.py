"""What one engine step costs, counted from the model config: FLOPs (linears, attention, lm_head)
and bytes moved (weights, KV read and written). `pdserve roofline` sets these beside measured
step times; the ratio of the two is each step's arithmetic intensity."""
from dataclasses import dataclass, replace

from pdserve.config import ModelConfig
from pdserve.layers.mla import MLAShape


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
    lm_head_itemsize: float = 0.0   # bytes per lm_head weight, if not weight_itemsize (int4 keeps it int8)
    # mixture of experts (none: 0): moe_layers layers of num_experts routed experts of expert_params
    # weights each, top_k per token; body_matmul_params then holds what every token reads (attention,
    # dense layers, shared experts, routers)
    moe_layers: int = 0
    num_experts: int = 0
    top_k: int = 0
    expert_params: int = 0
    expert_itemsize: float = 0.0    # bytes per expert weight, if not itemsize
    # what one token leaves in one layer's paged cache, in values (0: K and V, 2 x num_kv_heads x
    # head_dim), as the model's kv_spec declares it (models.kv_spec)
    kv_values: int = 0
    # multi-head latent attention (DeepSeek-V3; layers/mla.py): the cache holds one latent row of
    # kv_lora_rank + qk_rope_head_dim values; decodes attend over it in the absorbed form
    mla: MLAShape | None = None

    @classmethod
    def from_config(cls, m: ModelConfig, itemsize: int, weight_itemsize: float = 0.0) -> "ModelCost":
        return replace(cls._from_config(m, itemsize, weight_itemsize), **cache_of(m))

    @classmethod
    def _from_config(cls, m: ModelConfig, itemsize: int, weight_itemsize: float) -> "ModelCost":
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
        moe = moe_cost(m)
        if moe is not None:
            matmul, other, head, layers, experts, k, per_expert = moe
            return cls(L, H, Hkv, D, matmul, other, head, h, m.sliding_window, itemsize, weight_itemsize,
                       moe_layers=layers, num_experts=experts, top_k=k, expert_params=per_expert)
        qwen2 = m.architecture == "Qwen2ForCausalLM"
        qkv_bias = qwen2 or raw.get("attention_bias", False)
        o_bias = not qwen2 and raw.get("attention_bias", False)
        matmul = L * (2 * h * H * D + 2 * h * Hkv * D + 3 * h * I)
        biases = (H * D + 2 * Hkv * D if qkv_bias else 0) + (h if o_bias else 0) + \
                 (2 * I + h if raw.get("mlp_bias", False) else 0)
        other = L * (2 * h + biases) + h
        return cls(L, H, Hkv, D, matmul, other, h * m.vocab_size, h, m.sliding_window, itemsize, weight_itemsize)

    def experts_read(self, tokens: int) -> float:
        """The routed experts a step of `tokens` tokens reads, all layers: the expected number of
        distinct experts per layer when each token picks top_k of num_experts uniformly,
        E (1 - (1 - k/E)^T), times the MoE layers."""
        if not self.moe_layers or not tokens:
            return 0.0
        E, k = self.num_experts, self.top_k
        return self.moe_layers * E * (1 - (1 - k / E) ** tokens)

    @property
    def kv_bytes_per_token(self) -> int:
        """The paged cache's bytes per token, all layers: K and V, or MLA's latent row."""
        values = self.kv_values or 2 * self.num_kv_heads * self.head_dim
        return self.num_layers * values * self.itemsize

    def attention_flops(self, q: int, keys: int, kv_tokens: int) -> int:
        """One sequence's attention FLOPs in a step, all layers (2 a multiply-add): q new queries
        scoring `keys` query-key pairs, over kv_tokens cached tokens. MLA as layers/mla.py runs
        it: a decode (q == 1) in the absorbed form, q_nope through W_UK into the latent space,
        scores over the latent and rope parts, the sum over the latents, the result through W_UV;
        a prefill chunk expands every key's per-head K/V from its latent (kv_b) first."""
        L, H, s = self.num_layers, self.num_heads, self.mla
        if s is None:
            return 4 * L * H * self.head_dim * keys   # QK^T and PV
        r, up = s.kv_lora_rank, s.qk_nope_head_dim + s.v_head_dim   # kv_b: r -> per head nope + v
        if q == 1:
            return 2 * L * H * ((2 * r + s.qk_rope_head_dim) * keys + up * r)
        return 2 * L * H * ((s.qk_head_dim + s.v_head_dim) * keys + up * r * kv_tokens)


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


def cache_of(m: ModelConfig) -> dict:
    """kv_values and mla of a model, from its kv_spec (one plane: MLA's latent row)."""
    from pdserve.models import kv_spec
    spec = kv_spec(m)
    mla = None
    if spec.planes == 1:
        from pdserve.models.deepseek_v3 import mla_shape
        mla = mla_shape(m)
    return {"kv_values": spec.planes * spec.heads * spec.dim, "mla": mla}


def moe_cost(m: ModelConfig) -> tuple[int, int, int, int, int, int, int, int] | None:
    """A mixture-of-experts model's (matmul, other, lm_head params, moe_layers, num_experts, top_k,
    expert_params) counted from its own modules (built on the meta device: no memory), None for a
    dense model. matmul: the 2-D weights every token reads (attention, dense MLPs, shared experts,
    routers); other: norms and biases."""
    import torch
    from pdserve.layers.moe import FusedMoE, Router
    from pdserve.models import ARCHITECTURES
    if not hasattr(ARCHITECTURES[m.architecture], "checkpoint_tensors"):
        return None
    with torch.device("meta"):
        model = ARCHITECTURES[m.architecture](m)
    experts = [mod for mod in model.modules() if isinstance(mod, FusedMoE)]
    routers = [mod for mod in model.modules() if isinstance(mod, Router)]
    if not experts:
        return None
    routed = {id(p) for e in experts for p in e.parameters()}
    embed = dict(model.named_parameters())[f"{model.embed_module}.weight"]
    matmul = other = 0
    for name, p in model.named_parameters():
        if id(p) in routed or p is embed or name == "lm_head.weight":
            continue
        if p.dim() == 2:
            matmul += p.numel()
        else:
            other += p.numel()
    e = experts[0]
    per_expert = 3 * e.hidden_size * e.intermediate_size
    if any(x.num_experts != e.num_experts or 3 * x.hidden_size * x.intermediate_size != per_expert for x in experts):
        raise ValueError(f"{m.architecture}: layers with different experts")
    return (matmul, other, model.lm_head.weight.numel(), len(experts), e.num_experts,
            routers[0].routing.top_k, per_expert)


def step_cost(m: ModelCost, seqs: list[tuple[int, int]], logit_rows: int,
              experts_read: float | None = None) -> StepCost:
    """Cost of one forward over `seqs`, each (new tokens, context after the step), with logits
    for `logit_rows` rows. Attention counts the causal (useful) work: a query at position p scores
    and sums min(p + 1, window) keys. Bytes are the least a forward must move: every weight once
    (embedding rows per token, the lm_head only if some row gets logits), each sequence's K/V once,
    the new K/V written; activations are not counted. "K/V" is what the paged cache holds a
    token: for multi-head latent attention its latent row (kv_lora_rank + qk_rope_head_dim values
    a layer), which an absorbed decode reads as it is (kv_b, its W_UK and W_UV, is read once with
    the weights). A mixture of experts reads the routed experts the step selects, once each:
    `experts_read` (distinct (layer, expert) pairs, e.g. counted from the routers), by default the
    expectation under uniform routing (ModelCost.experts_read); every token multiplies by its top_k
    experts."""
    T = sum(q for q, _ in seqs)
    kv_tokens = attn = 0
    for q, c in seqs:
        w = m.sliding_window or c
        seen = min(c, q + w - 1)   # the keys any of its queries sees, each read once
        kv_tokens += seen
        attn += m.attention_flops(q, sum(min(p + 1, w) for p in range(c - q, c)), seen)
    linear_size = m.weight_itemsize or m.itemsize
    head = (m.lm_head_params if logit_rows else 0) * (m.lm_head_itemsize or linear_size)
    experts = m.experts_read(T) if experts_read is None else experts_read
    routed = m.moe_layers * m.top_k * m.expert_params   # the expert weights each token multiplies by
    return StepCost(
        flops_linear=2 * (m.body_matmul_params + routed) * T,
        flops_attn=attn,
        flops_lm_head=2 * m.lm_head_params * logit_rows,
        bytes_weights=round(m.body_matmul_params * linear_size + head
                            + experts * m.expert_params * (m.expert_itemsize or m.itemsize)
                            + (m.body_other_params + m.embed_row_params * T) * m.itemsize),
        bytes_kv_read=kv_tokens * m.kv_bytes_per_token,
        bytes_kv_write=T * m.kv_bytes_per_token)


def phase_steps(phase: str, batch: int, context: int) -> tuple[list[tuple[int, int]], int]:
    """The sequences of one measured step and how many get logits."""
    if phase == "decode":
        return [(1, context)] * batch, batch
    return [(context, context)], 1   # prefill, and nocache: one token by re-running the whole sequence
