"""Quick GPU facts the code relies on: mm/addmm with out_dtype=fp32 on bf16 inputs."""
import torch

a = torch.randn(256, 512, device="cuda", dtype=torch.bfloat16)
b = torch.randn(512, 128, device="cuda", dtype=torch.bfloat16)
ref = a.float() @ b.float()
y = torch.mm(a, b, out_dtype=torch.float32)
print("mm out_dtype", y.dtype, (y - ref).abs().max().item())
c = torch.ones(256, 128, device="cuda")
try:
    p = c.data_ptr()
    torch.addmm(c, a, b, out_dtype=torch.float32, out=c)
    print("addmm out_dtype in place ok", c.data_ptr() == p, (c - 1 - ref).abs().max().item())
except Exception as e:  # noqa: BLE001
    print("addmm out_dtype failed:", repr(e)[:300])
