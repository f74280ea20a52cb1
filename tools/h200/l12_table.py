"""Issue #5, eighth lease, last call: the committed 12-bit kernels' table (default launch, M = 1, 4, 16, 64, the
Llama-3-8B shapes, torch bf16 timed beside each row; `python -m specpilot.kernels.lossless12_linear --no-sweep`),
and the device copy bandwidth measured two ways: 1 GiB uint8 `copy_` captured in a CUDA graph (what `benchmark`
reported so far: 2.6-2.8 TB/s this lease) and the same copy run eagerly, timed with CUDA events, fastest of 7 (as
tools/calibrate.py measures it). Writes $OUT/l12_table.json and $OUT/copy.json."""
import json
import os

import torch

from specpilot.kernels import lossless12_linear as L

OUT = os.environ.get("OUT", ".")
n = 1 << 30
src = torch.empty(n, dtype=torch.uint8, device="cuda").random_()
dst = torch.empty_like(src)
graph = 2 * n / L._graph_time(lambda i: dst.copy_(src), 1, 4)
times = []
for _ in range(8):
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    dst.copy_(src)
    b.record()
    b.synchronize()
    times.append(a.elapsed_time(b) * 1e-3)
eager = 2 * n / min(times[1:])
print(f"copy bandwidth: in a CUDA graph {graph / 1e12:.2f} TB/s, eager {eager / 1e12:.2f} TB/s", flush=True)
json.dump(dict(graph_tbps=graph / 1e12, eager_tbps=eager / 1e12), open(os.path.join(OUT, "copy.json"), "w"))
del src, dst
L.main(["--no-sweep", "--out", os.path.join(OUT, "l12_table.json")])
