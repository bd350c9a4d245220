"""OPT (the family of the server we grew out of): learned positions offset by 2, LayerNorm,
ReLU MLP, pre-LN (125m) or post-LN (350m) blocks, optional project_in/project_out."""
import torch
import torch.nn.functional as F
from torch import nn

from pdserve.config import ModelConfig
from pdserve.layers.attention import PagedAttention
from pdserve.layers.merged_linear import MergedLinear
from pdserve.models.decoder_spec import DecoderSpec

# OPT's learned position table has two extra leading rows (a fairseq padding convention).
POSITION_OFFSET = 2
ACTIVATIONS = {"relu": F.relu, "gelu": F.gelu, "silu": F.silu}


class OPTAttention(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        H, D, bias = cfg.num_heads, cfg.head_dim, cfg.raw.get("enable_bias", True)
        self.qkv_proj = MergedLinear(cfg.hidden_size, [H * D] * 3, bias=bias)
        self.out_proj = nn.Linear(H * D, cfg.hidden_size, bias=bias)
        self.attn = PagedAttention(H, H, D, scale=D ** -0.5)
        self.H, self.D = H, D

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        T = x.shape[0]
        q, k, v = (t.view(T, self.H, self.D) for t in self.qkv_proj(x).chunk(3, dim=-1))
        return self.out_proj(self.attn(q, k, v))


class OPTDecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        affine, bias = cfg.raw.get("layer_norm_elementwise_affine", True), cfg.raw.get("enable_bias", True)
        self.self_attn = OPTAttention(cfg)
        self.self_attn_layer_norm = nn.LayerNorm(cfg.hidden_size, elementwise_affine=affine)
        self.fc1 = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=bias)
        self.fc2 = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=bias)
        self.final_layer_norm = nn.LayerNorm(cfg.hidden_size, elementwise_affine=affine)
        self.act_name = cfg.raw.get("activation_function", "relu")
        self.act = ACTIVATIONS[self.act_name]
        self.pre_ln = cfg.raw.get("do_layer_norm_before", True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.self_attn(self.self_attn_layer_norm(x) if self.pre_ln else x)
        x = x + h
        if not self.pre_ln:
            x = self.self_attn_layer_norm(x)
        h = self.fc2(self.act(self.fc1(self.final_layer_norm(x) if self.pre_ln else x)))
        x = x + h
        if not self.pre_ln:
            x = self.final_layer_norm(x)
        return x


class OPTDecoder(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        proj_dim = cfg.raw.get("word_embed_proj_dim") or cfg.hidden_size
        self.embed_tokens = nn.Embedding(cfg.vocab_size, proj_dim)
        self.embed_positions = nn.Embedding(cfg.max_position_embeddings + POSITION_OFFSET, cfg.hidden_size)
        self.project_in = nn.Linear(proj_dim, cfg.hidden_size, bias=False) if proj_dim != cfg.hidden_size else None
        self.project_out = nn.Linear(cfg.hidden_size, proj_dim, bias=False) if proj_dim != cfg.hidden_size else None
        # 350m-style (post-LN) checkpoints have no final norm
        has_final = cfg.raw.get("do_layer_norm_before", True) and not cfg.raw.get("_remove_final_layer_norm", False)
        self.final_layer_norm = (nn.LayerNorm(cfg.hidden_size, elementwise_affine=cfg.raw.get(
            "layer_norm_elementwise_affine", True)) if has_final else None)
        self.layers = nn.ModuleList(OPTDecoderLayer(cfg) for _ in range(cfg.num_layers))

    def embed(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        x = self.embed_tokens(input_ids)
        if self.project_in is not None:
            x = self.project_in(x)
        return x + self.embed_positions(positions + POSITION_OFFSET)

    def finish(self, x: torch.Tensor) -> torch.Tensor:
        """The final norm and project_out after the layers, in the model's dtype."""
        x = x.to(self.embed_positions.weight.dtype)
        if self.final_layer_norm is not None:
            x = self.final_layer_norm(x)
        if self.project_out is not None:
            x = self.project_out(x)
        return x

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        x = self.embed(input_ids, positions)
        for layer in self.layers:
            x = layer(x)
        return self.finish(x)


class OPTModel(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.decoder = OPTDecoder(cfg)


class OPTForCausalLM(nn.Module):
    stacked_params = {"q_proj": ("qkv_proj", 0), "k_proj": ("qkv_proj", 1), "v_proj": ("qkv_proj", 2)}  # see llama.py
    embed_module = "model.decoder.embed_tokens"

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.model = OPTModel(cfg)
        proj_dim = cfg.raw.get("word_embed_proj_dim") or cfg.hidden_size
        self.lm_head = nn.Linear(proj_dim, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.decoder.embed_tokens.weight

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return self.model.decoder(input_ids, positions)

    def decoder_spec(self) -> DecoderSpec:
        """The layers' recipe (models/decoder_spec.py): pre-LN (125m) or post-LN (350m), no RoPE (the
        positions are in the embedding); the final norm and project_out stay in finish()."""
        first = self.model.decoder.layers[0]
        return DecoderSpec(layers="model.decoder.layers", attn_norm="self_attn_layer_norm", qkv="self_attn.qkv_proj",
                           attention="self_attn.attn", o="self_attn.out_proj", mlp_norm="final_layer_norm", up="fc1",
                           down="fc2", activation=first.act_name, norm_position="pre" if first.pre_ln else "post")

    def embed(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """The first layer's input (for a backend that runs the layers itself)."""
        return self.model.decoder.embed(input_ids, positions)

    def finish(self, hidden: torch.Tensor) -> torch.Tensor:
        """The hidden states from the last layer's output."""
        return self.model.decoder.finish(hidden)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden)
