"""Layout lottery: the same AR step graph, N decoder instances in one process, timed in turn; then each recaptured
with its old graphs kept alive (its pool at new addresses) and timed again; per-kernel times of the fastest and
slowest instance."""
import importlib.util, json, os, statistics, sys, time
sys.path[:0] = ["/tmp/pkg", "/tmp/site", "benchmarks"]
import torch
from specpilot.engine import loader
from specpilot.engine.engine import Engine
from specpilot.engine.sampling import SamplingParams
spec = importlib.util.spec_from_file_location("lo", "benchmarks/experiments/loop_overhead.py")
lo = importlib.util.module_from_spec(spec); spec.loader.exec_module(lo)
N, B, AHEAD = int(os.environ.get("N", 4)), int(os.environ.get("B", 2)), 200
SYS = os.environ.get("SYS", "ar-fused-overlap")
DEV = os.environ.get("DEV", "cuda")
GGUF = os.environ.get("GGUF", "/tmp/smollm2/model.gguf")
target = loader.load(GGUF, "bf16" if DEV == "cuda" else "fp32", DEV)
engines = []
for i in range(N):
    t = time.time()
    eng = Engine(target, lo.system_recipe(SYS, GGUF, DEV))
    eng.warmup([B], 300, 128)
    engines.append(eng)
    print(f"instance {i} warm in {time.time()-t:.0f} s", flush=True)

def kind0(dec):
    return 0 if 0 in dec._step_kinds() else dec._step_kinds()[-1]

def rounds(label, n=7):
    times = {i: [] for i in range(N)}
    for _ in range(n):
        for i, eng in enumerate(engines):
            dec = eng.decoder
            st = dec._use(B, 0)
            times[i].append(dec._time_step(st, kind0(dec), 20, AHEAD) * 1e3)
    med = {i: statistics.median(v) for i, v in times.items()}
    lo_, hi = min(med.values()), max(med.values())
    print(f"{label}: " + ", ".join(f"#{i} {m:.4f}" for i, m in med.items()) + f"  spread {100*(hi/lo_-1):.2f}%", flush=True)
    return med

base = rounds("instances")
again = rounds("instances again")
kept = []
for rec in range(3):
    for eng in engines:
        dec = eng.decoder
        kept.append(dict(dec._graphs))  # the old graphs (and their pools) stay alive
        kept.append(torch.empty(int(1 << 20) * (3 + rec) + 4096 * (rec + 1), dtype=torch.uint8, device=DEV))
        dec.forget_steps()
        st = dec._use(B, 0)
        dec._graph(st, SamplingParams(), kind0(dec))
    rounds(f"recaptured {rec + 1}")
med = rounds("final")
fast, slow = min(med, key=med.get), max(med, key=med.get)
if DEV != "cuda":
    sys.exit(0)
ks = {}
for i in (fast, slow):
    dec = engines[i].decoder
    dec._use(B, 0)
    ks[i] = lo.step_kernels(dec, kind0(dec), 20)["kernels"]
names = sorted(set(ks[fast]) | set(ks[slow]), key=lambda n: -abs(ks[slow].get(n, {"us": 0})["us"] - ks[fast].get(n, {"us": 0})["us"]))
print(f"kernels, fast #{fast} against slow #{slow} (us a step):")
for n in names[:15]:
    a, b = ks[fast].get(n, {"us": 0, "per_step": 0}), ks[slow].get(n, {"us": 0, "per_step": 0})
    print(f"  {a['us']:8.2f} {b['us']:8.2f} {b['us']-a['us']:+7.2f}  x{a['per_step']:.0f}  {n[:110]}")
print("totals", sum(v["us"] for v in ks[fast].values()), sum(v["us"] for v in ks[slow].values()))
