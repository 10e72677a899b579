import torch, mmdeform_tma
v = torch.randn(1, 20, 2, 128, device="cuda")
ss = torch.tensor([[4, 5]], device="cuda"); st = torch.tensor([0], device="cuda")
loc = torch.rand(1, 3, 2, 1, 2, 2, device="cuda"); a = torch.rand(1, 3, 2, 1, 2, device="cuda")
try:
    torch.ops.mmdeform_tma.ms_deform_attn_forward(v, ss, st, loc, a, "tma", -1)
except Exception as e:
    print("raised:", type(e).__name__, str(e)[:200])
