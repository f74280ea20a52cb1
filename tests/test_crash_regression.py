"""Issue #20: `specpilot bench ... --baselines hf` died at B = 32 with `CUDA error: unspecified launch failure`.

The root cause: every CUDA graph the decoder captured on torch.cuda.graph's default capture stream baked in the one
cuBLAS workspace PyTorch caches per (handle, stream), allocated by whichever capture came first. HF's static-cache
`generate` compiles with mode "reduce-overhead", whose CUDA-graph trees clear that cache before and after every
warm-up and recording (torch._C._cuda_clearCublasWorkspaces); the workspace was freed under our graphs and unmapped
by the next capture's empty_cache once its pool was released: the next replay faulted. engine.decode.capture gives
each capture a workspace of its own, in its own pool.

Two more faults of the same kind were found on the way and are covered here: the model's RoPE tables, shared by every
decoder on the model, were freed when one decoder needed longer ones while the others' graphs still read them; and
the n-gram search kernel read up to BLOCK_S tokens past each row's end, past the history tensor's for the last row.

On the CPU: the capture discipline (order of clears and capture), the RoPE tables' lifetime, and the n-gram kernel
under Triton's interpreter against a history tensor followed by an inaccessible page. On a GPU, `test_graphs_survive_
a_cublas_workspace_clear` runs this file as a script: the decoder's graphs replayed after what the graph trees do
must give the tokens they gave before (`python tests/test_crash_regression.py --old` shows the fault without the fix).
"""
from __future__ import annotations

import gc
import os
import subprocess
import sys
import weakref
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]


def test_capture_clears_the_cublas_workspace_cache_around_the_capture(monkeypatch):
    from specpilot.engine import decode

    events = []
    monkeypatch.setattr(torch._C, "_cuda_clearCublasWorkspaces", lambda: events.append("clear"), raising=False)

    @contextmanager
    def fake_graph(graph, pool=None):
        events.append(("capture", graph, pool))
        yield
        events.append("end")

    monkeypatch.setattr(torch.cuda, "graph", fake_graph)
    with decode.capture("g", pool="p"):
        events.append("body")
    assert events == ["clear", ("capture", "g", "p"), "body", "end", "clear"]

    events.clear()
    with pytest.raises(RuntimeError):
        with decode.capture("g"):
            raise RuntimeError("capture failed")
    assert events == ["clear", ("capture", "g", None), "clear"]  # a failed capture leaves no workspace shared


def test_decoder_captures_only_through_capture():
    """Every graph the decoder captures goes through `capture` (a bare torch.cuda.graph would share the workspace)."""
    source = (ROOT / "engine" / "decode.py").read_text()
    assert source.count("with torch.cuda.graph(") == 1  # the one inside capture()
    assert source.count("with capture(") == 2  # the step and the prefill


def test_rope_tables_outlive_a_longer_cache():
    from specpilot.engine.model import ModelConfig, Transformer

    cfg = ModelConfig("llama", 32, 16, 32, 1, 2, 1, 8, 1e-5, False, True, (None,))
    model = Transformer(cfg, 1.0 / (10000 ** (torch.arange(0, 8, 2).float() / 8)))
    model.new_cache(1, 512)
    cos, sin = model._rope
    refs = [weakref.ref(cos), weakref.ref(sin)]
    ptr = cos.data_ptr()
    del cos, sin
    model.new_cache(1, 1024)  # another decoder on the same model needs a longer table
    gc.collect()
    assert model._rope[0].shape[0] == 1024
    assert all(r() is not None for r in refs), "graphs captured with the old table would read freed memory"
    assert refs[0]().data_ptr() == ptr


GUARD_SCRIPT = r"""
import ctypes, mmap, sys
import torch
from specpilot.kernels.triton_ngram import ngram_search
PAGE = mmap.PAGESIZE
S = PAGE // 8  # one int64 row of S tokens fills one page; the page after it is made inaccessible
mm = mmap.mmap(-1, 2 * PAGE)
addr = ctypes.addressof(ctypes.c_char.from_buffer(mm))
libc = ctypes.CDLL(None, use_errno=True)
assert libc.mprotect(ctypes.c_void_p(addr + PAGE), ctypes.c_size_t(PAGE), 0) == 0
history = torch.frombuffer(mm, dtype=torch.int64, count=S).view(1, S)
history.copy_(torch.arange(S) % 7)
for length in (S, S - 3, 5, 1):
    tokens, valid = ngram_search(history, torch.tensor([length]), 4, 4, 2)
    print(length, tokens.tolist(), valid.tolist())
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="mprotect guard page: Linux")
@pytest.mark.skipif(os.path.exists("/dev/nvidia0"), reason="a CPU check under Triton's interpreter (as conftest runs "
                    "kernels); on a GPU, compute-sanitizer memcheck shows the read")
def test_ngram_search_reads_nothing_past_the_history():
    pytest.importorskip("triton")
    proc = subprocess.run([sys.executable, "-c", GUARD_SCRIPT], env={**os.environ, "TRITON_INTERPRET": "1"},
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, f"n-gram search read past the history (rc {proc.returncode}): {proc.stderr[-2000:]}"


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_graphs_survive_a_cublas_workspace_clear():
    proc = subprocess.run([sys.executable, str(Path(__file__))], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    assert "same tokens" in proc.stdout


# -- the GPU check, run as a script ---------------------------------------------------------------------------------
def _gpu_check(old: bool) -> None:
    """A SmolLM2-shaped random model decoded with CUDA graphs at B = 2, then B = 32 (the B = 2 graphs and their pools
    are dropped, as between bench cells); then what a torch.compile "reduce-overhead" recording does around us (clear
    the cuBLAS workspace cache, capture a graph: empty_cache); then B = 32 again, replaying the graphs captured before.
    `old`: captures as before the fix (a bare torch.cuda.graph)."""
    import tempfile

    from transformers import AutoModelForCausalLM, LlamaConfig

    from specpilot.engine import decode, loader

    if old:
        decode.capture = lambda graph, pool=None: torch.cuda.graph(graph, pool=pool)
    cfg = LlamaConfig(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=4,
                      num_attention_heads=9, num_key_value_heads=3, max_position_embeddings=2048,
                      tie_word_embeddings=True, bos_token_id=None, eos_token_id=None, pad_token_id=None)
    torch.manual_seed(0)
    with tempfile.TemporaryDirectory() as tmp:
        hf = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
        with torch.no_grad():
            for name, p in hf.named_parameters():
                p.copy_(1.0 + 0.05 * torch.randn_like(p)) if "norm" in name else torch.nn.init.normal_(p, std=0.2)
        hf.save_pretrained(tmp)
        target = loader.load(tmp, "bf16", "cuda")
    dec = decode.Decoder(target.model, cuda_graphs=True)
    stop = decode.StopCondition(32, eos_token_ids=())
    g = torch.Generator().manual_seed(1)
    # B = 32 prompts of ~300 tokens: prefill GEMMs of ~10k rows, as in the bench (cuBLAS uses its workspace there)
    prompts = [torch.randint(0, 49152, (int(n),), generator=g).tolist() for n in torch.randint(250, 300, (32,))]
    dec.generate(prompts[:2], stop)
    first = [r.tokens for r in dec.generate(prompts, stop)]
    torch.cuda.synchronize()
    torch._C._cuda_clearCublasWorkspaces()  # what the graph trees do before and after each warm-up and recording
    other = torch.cuda.CUDAGraph()
    x = torch.ones(64, 64, device="cuda")
    with torch.cuda.graph(other):  # any capture: torch.cuda.graph empties the allocator's cache first
        x @ x
    del other
    again = [r.tokens for r in dec.generate(prompts, stop)]  # before the fix: a replay into unmapped memory
    torch.cuda.synchronize()
    assert again == first, "replayed graphs gave other tokens"
    print("same tokens after the workspace clear")


if __name__ == "__main__":
    _gpu_check("--old" in sys.argv)
