"""The CUDA backend's paged attention: PagedAttention's state, its forward on the Triton kernels
(kernels.py) when the step's metadata is theirs (metadata.py), the torch path's otherwise."""
import torch

from pdserve.backends.cuda import kernels
from pdserve.backends.cuda.metadata import CudaAttentionMetadata
from pdserve.layers.attention import PagedAttention, get_attention_metadata


class CudaPagedAttention(PagedAttention):
    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        meta = get_attention_metadata()
        if not isinstance(meta, CudaAttentionMetadata):
            return super().forward(q, k, v)
        kernels.store_kv(k, v, self.k_cache, self.v_cache, meta.slot_mapping)
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
        kernels.paged_attention(q, self.k_cache, self.v_cache, out, meta, self.scale, self.sliding_window,
                                self.logit_softcap, None if self.sinks is None else self.sinks.detach())
        return out.view(q.shape[0], -1)


def use_kernel_attention(model: torch.nn.Module) -> int:
    """Swap each PagedAttention's class for CudaPagedAttention (its state unchanged); returns how many."""
    swapped = 0
    for m in model.modules():
        if type(m) is PagedAttention:
            m.__class__ = CudaPagedAttention
            swapped += 1
    return swapped
