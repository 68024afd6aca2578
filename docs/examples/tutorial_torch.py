"""The PyTorch tutorial of docs/conformance.md, as run by the test suite."""

import math

import torch
import torch.nn.functional as F

from conformance import verify


def sdpa(q, k, v, *, mask=None, bias=None, is_causal=False, scale=None):
    attn = mask
    if bias is not None:
        attn = bias if mask is None else bias.masked_fill(~mask, -math.inf)
    if is_causal and attn is not None:        # SDPA takes one or the other
        tri = torch.ones(q.shape[-2], k.shape[-2], dtype=torch.bool).tril()
        attn = attn & tri if attn.dtype == torch.bool else attn.masked_fill(~tri, -math.inf)
        is_causal = False
    return F.scaled_dot_product_attention(q, k, v, attn_mask=attn, is_causal=is_causal,
                                          scale=scale)


report = verify(sdpa, "softmax", backend="torch", dtypes=("float16", "bfloat16"),
                supports={"broadcast": True})
print(report.table())
assert report.passed
