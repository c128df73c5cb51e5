"""Tensor parallelism: Megatron's column/row-parallel Linear pairs. The pairing rule (which layers pair) is read
in the kernel (pairs.py); the split itself runs on the engines (ranks/)."""
