import torch, torch.nn.functional as F
op = torch.ops.aten
def rel(a, b): return float((a.double() - b.double()).norm() / b.double().norm())
torch.manual_seed(0)
q, k, v, d = (torch.randn(1, 4, 512, 64, device="cuda", dtype=torch.bfloat16) for _ in range(4))
L = [t.clone().requires_grad_() for t in (q, k, v)]
F.scaled_dot_product_attention(*L, scale=0.125, is_causal=True).backward(d)
try:
    r = op._scaled_dot_product_cudnn_attention(q, k, v, None, True, 0.0, True, False, scale=0.125)
    print("cudnn fwd out", r[0].stride(), "lse", tuple(r[1].shape), r[1].stride(), r[1].dtype, "seed", r[6], "off", r[7], "cum", r[2], r[4], r[5])
    lse_ref = torch.logsumexp((q.float() @ k.float().transpose(-1, -2) * 0.125).masked_fill(torch.ones(512, 512, device="cuda", dtype=torch.bool).triu(1), float("-inf")), -1)
    print("lse vs exact", rel(r[1].reshape(1, 4, 512), lse_ref))
    g = op._scaled_dot_product_cudnn_attention_backward(d, q, k, v, r[0], r[1], r[6], r[7], None, None, None, 512, 512, 0.0, True, scale=0.125)
    print("own-state bwd", [round(rel(a, b.grad), 4) for a, b in zip(g, L)])
except Exception as e:
    print("probe error", type(e).__name__, str(e)[:500])
