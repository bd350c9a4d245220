"""Linears that read the same input, stored as one: q/k/v and gate/up.

One product of N1 + N2 + ... output channels instead of several: fewer kernel launches (a
batch-1 decode step is 24 layers of small products) and wider products that split better over
threads. The checkpoint keeps the separate HF tensors; the loader copies each into its rows
(a model's `stacked_params`: checkpoint module name -> (merged module name, shard index))."""
import torch
from torch import nn


class MergedLinear(nn.Linear):
    def __init__(self, in_features: int, output_sizes: list[int], bias: bool):
        super().__init__(in_features, sum(output_sizes), bias=bias)
        self.output_sizes = list(output_sizes)

    def shard_rows(self, index: int) -> tuple[int, int]:
        """(first row, rows) of shard `index` in the merged weight and bias."""
        return sum(self.output_sizes[:index]), self.output_sizes[index]

