"""Quick end-to-end check of layerswap under PyTorch on a GPU (used before the full suites run).

python bench/smoke.py [native|layerswap]: prints memory API figures, trains a small model, times alloc+free.
"""
import sys
import time

mode = sys.argv[1] if len(sys.argv) > 1 else "layerswap"
import torch  # noqa: E402

if mode == "layerswap":
    import layerswap

    layerswap.enable()
    print("enabled:", layerswap.is_enabled(), torch.cuda.memory.get_allocator_backend() if hasattr(torch.cuda.memory, "get_allocator_backend") else "")
from layerswap import _C  # noqa: E402

x = torch.randn(1024, 1024, device="cuda")
y = x @ x
torch.cuda.synchronize()
print("allocated", torch.cuda.memory_allocated(), "reserved", torch.cuda.memory_reserved(), "max", torch.cuda.max_memory_allocated())
st = torch.cuda.memory_stats()
print({k: v for k, v in st.items() if k.endswith("all.current")})
torch.manual_seed(0)
m = torch.nn.Sequential(*[torch.nn.Linear(2048, 2048) for _ in range(8)]).cuda().bfloat16()
opt = torch.optim.AdamW(m.parameters())
t0 = time.perf_counter()
for i in range(20):
    loss = m(torch.randn(64, 2048, device="cuda", dtype=torch.bfloat16)).float().square().mean()
    loss.backward()
    opt.step()
    opt.zero_grad()
torch.cuda.synchronize()
print("loss", loss.item(), "20 steps", time.perf_counter() - t0)
for s in [512, 4096, 1 << 20, 2 << 20, 64 << 20, 256 << 20]:
    print("alloc+free", s, round(_C.bench_alloc_free(s, 500), 3), "us")
del x, y
torch.cuda.empty_cache()
print("after empty_cache reserved", torch.cuda.memory_reserved(), "allocated", torch.cuda.memory_allocated())
if mode == "layerswap":
    print(layerswap.stats())
    print(_C.stats_report())
