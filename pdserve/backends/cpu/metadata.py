"""One step's attention metadata for the CPU kernels: no mask, no padding.

The step's integers go into one list, which one C++ call (AttentionStep.from_ints, kernels/ops.cpp)
copies with the block tables (cut or padded there) into an int64 buffer and views as the flat
tensors and an AttentionStep. Between two forwards each torch call runs cold: array(), frombuffer
and a split into views cost ~60 us at batch 32 there."""
import torch

from pdserve.backends.cpu.kernels import cpu_ops
from pdserve.layers.attention import AttentionMetadata


def build_step_metadata(flat: list[list[int]], groups: list[tuple], block_size: int
                        ) -> tuple[list[torch.Tensor], AttentionMetadata]:
    """layers/attention.py's build_metadata (the same arguments) for the kernels."""
    T = len(flat[-1])
    ints = []
    for x in flat:   # the runner's three lists are all T long
        assert len(x) == T
        ints += x
    dec = pre = None
    for g in groups:
        if max(g[0]) == 1:
            dec = g
        else:
            pre = g
    dec_tables, pre_tables, nb_dec, nb_pre, first_row = [], [], 0, 0, -1
    if dec is not None:
        _, starts, ctx_lens, dec_tables = dec
        ints += ctx_lens
        nb_dec = (max(ctx_lens) + block_size - 1) // block_size
        if starts[-1] - starts[0] == len(starts) - 1:   # rows first_row..: a slice, not an index op
            first_row = starts[0]
        else:
            ints += starts
    if pre is not None:
        q_lens, starts, ctx_lens, pre_tables = pre
        ints += starts + q_lens + ctx_lens
        nb_pre = (max(ctx_lens) + block_size - 1) // block_size
    tensors, step = cpu_ops().AttentionStep.from_ints(ints, dec_tables, pre_tables, len(flat), T, len(dec_tables),
                                                      nb_dec, first_row, len(pre_tables), nb_pre, block_size)
    slots = step.slot_mapping
    return tensors + [slots], AttentionMetadata(slots, [], step)
