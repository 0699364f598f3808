"""TEMPORARY stand-in until the kernel branch lands (replaced by the kernel triple)."""
import torch


def paged_attention_decode_ref(q, k_cache, v_cache, block_tables, seq_lens, scale, *, out=None):
    B, Hq, P = q.shape
    bs, Hkv = k_cache.shape[2], k_cache.shape[1]
    res = torch.empty_like(q) if out is None else out
    for b in range(B):
        n = int(seq_lens[b])
        nb = -(-n // bs)
        blocks = block_tables[b, :nb].long()
        k = k_cache[blocks].permute(0, 2, 1, 3).reshape(-1, Hkv, P)[:n].float()
        v = v_cache[blocks].permute(0, 2, 1, 3).reshape(-1, Hkv, P)[:n].float()
        k = k.repeat_interleave(Hq // Hkv, dim=1)
        v = v.repeat_interleave(Hq // Hkv, dim=1)
        w = torch.einsum("hp,thp->ht", q[b].float(), k) * scale
        res[b] = torch.einsum("ht,thp->hp", w.softmax(-1), v).to(q.dtype)
    return res


paged_attention_decode = paged_attention_decode_ref
