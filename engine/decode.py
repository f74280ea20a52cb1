"""The decoding loop: autoregressive greedy, chain speculative decoding, and speculative sampling, for ragged batches.

One step, for every row b of the batch at once: the drafter proposes up to k tokens after the row's last token;
the target scores [last, d_1..d_k] at positions len_b-1 .. len_b-1+k in one forward; the acceptance rule keeps the
longest verified prefix plus one token of the target's own; the row advances by that many tokens. With no drafter
(k = 0) the same step is plain autoregressive decoding. All of a step's tensors have static shapes, so on CUDA a
greedy step (drafting, verification and acceptance together) is captured once as a CUDA graph and replayed; the one
host sync per step reads the accepted tokens, which the host needs anyway for stop conditions. Shapes stay static,
but work need not: greedy verification marks the slots past each row's valid drafts as dead, and a layer that can
skip them (the fused layer) does; with `drafter.adaptive` each row's draft budget follows its acceptance. With
`ar_after_miss` the host runs a plain AR step (one token, no verification: a graph of its own) when the drafter found
nothing at the latest step it has read, since even a dead slot costs something; the drafter still searches in AR
steps, so verification resumes as soon as it finds drafts again.
"""
from __future__ import annotations

import time
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch

from ..kernels import Kernels, resolve as resolve_kernels
from ..kernels.builtin import attention_sdpa
from .drafters import Drafter
from .errors import SpecPilotError
from .model import Block, KVCache, Transformer, compiled
from .sampling import SamplingParams, accept_sampled, probabilities


@dataclass
class StopCondition:
    max_new_tokens: int
    eos_token_ids: tuple[int, ...] | None = None  # None: the model's own; (): never stop on EOS
    stop_strings: tuple[str, ...] = ()


@dataclass
class RowResult:
    prompt: list[int]
    tokens: list[int] = field(default_factory=list)
    finish_reason: str = ""
    accepted: list[int] = field(default_factory=list)  # drafts accepted at each verification step
    token_times: list[float] = field(default_factory=list)  # seconds from the batch start at which each token arrived
    text: str = ""

    @property
    def mean_accepted(self) -> float:
        """Mean tokens emitted per target step (accepted drafts + 1): tau."""
        return (sum(self.accepted) + len(self.accepted)) / len(self.accepted) if self.accepted else 1.0


@dataclass
class BatchStats:
    prefill_s: float = 0.0
    decode_s: float = 0.0
    steps: int = 0
    ar_steps: int = 0  # of them, steps run without verification (ar_after_miss)


PREFILL_WIDTH_STEP = 64  # with CUDA graphs, prompts are padded to a multiple of this: one prefill graph per width


def prefill_width(longest_prompt: int) -> int:
    """The padded prompt width a batch prefills at with CUDA graphs."""
    return -(-longest_prompt // PREFILL_WIDTH_STEP) * PREFILL_WIDTH_STEP


def cache_length(longest_prompt: int, max_new_tokens: int, k: int, overlap: bool = False) -> int:
    """KV-cache slots a batch gets: room for the prompt, the new tokens and one (with overlap two) steps of k + 1
    verified tokens, rounded up to a power of two so later batches reuse the cache and with it the compiled kernels
    and captured graphs (every shape change costs a recompile and a recapture). Attention reads all of it."""
    need = longest_prompt + max_new_tokens + (k + 1) * (2 if overlap else 1) + 1
    return max(512, 1 << (need - 1).bit_length())


@contextmanager
def capture(graph, pool=None):
    """`torch.cuda.graph(graph, pool=pool)` whose captured GEMMs use a cuBLAS workspace that the graph owns.

    cuBLAS takes its workspace from PyTorch's process-wide cache, one per (handle, stream); every graph captured on
    torch.cuda.graph's one default capture stream bakes in that same pointer, allocated by whichever capture came
    first (into that graph's private pool). Whoever clears the cache frees the workspace under every such graph:
    torch.compile's CUDA-graph trees (mode "reduce-overhead", which HF's static-cache `generate` uses) clear it
    before and after each warm-up and recording, and the next capture's `empty_cache` then unmaps it once its pool
    is released: our graphs' next replay wrote into freed, then unmapped memory and faulted ("unspecified launch
    failure", issue #20; tests/test_crash_regression.py reproduces it on a GPU). So, as the graph trees do: clear
    before the capture, so that the capture allocates a fresh workspace into this graph's pool, and after it, so
    that no later capture or clear shares or frees it. It then lives in the graph's pool as long as the graph does."""
    torch._C._cuda_clearCublasWorkspaces()
    try:
        with torch.cuda.graph(graph, pool=pool):
            yield
    finally:
        torch._C._cuda_clearCublasWorkspaces()


class DecodeState:
    """Static device buffers of one batch: every token so far, per-row lengths, and the step's outputs."""

    def __init__(self, batch: int, max_len: int, k: int, device):
        self.history = torch.zeros(batch, max_len, dtype=torch.long, device=device)
        self.lengths = torch.zeros(batch, dtype=torch.long, device=device)
        self.active = torch.ones(batch, dtype=torch.bool, device=device)
        # [n_accepted, tokens (k + 1: the step's accepted drafts and the target's token)..., drafts proposed]
        self.out = torch.zeros(batch, k + 3, dtype=torch.long, device=device)
        self.budget = torch.full((batch,), k, dtype=torch.long, device=device)  # drafts a row may verify next


def _record(history, lengths, active, out, n_acc, tokens) -> None:
    """Append each row's emitted tokens (tokens[:, :n_acc+1]) to its history and publish them in `out`."""
    S, width = history.shape[1], tokens.shape[1]
    slots = (lengths[:, None] + torch.arange(width, device=tokens.device)[None]).clamp(max=S - 1)
    history.scatter_(1, slots, tokens)  # slots past n_acc hold junk beyond the row's length: never read
    lengths.add_((n_acc + 1) * active)
    out[:, 0].copy_(n_acc)
    out[:, 1: 1 + width].copy_(tokens)


def _step_inputs(history, lengths, budget, drafts, valid, adaptive: bool, greedy: bool):
    """A step's target inputs [last, drafts...] and their cache positions; each row's valid drafts (within its budget
    when the draft length is adaptive); and for greedy verification the live tokens: the logits are read only up to
    each row's valid drafts, so the slots after them are dead, and a layer that can skip them does (a step without
    drafts then costs about what an AR step does). AR (drafts None): no drafts, no live mask."""
    S = history.shape[1]
    last = history.gather(1, (lengths - 1)[:, None])
    if drafts is None:
        inputs, valid = last, torch.zeros_like(lengths)
    else:
        inputs = torch.cat([last, drafts], 1)
        if adaptive:
            valid = torch.minimum(valid, budget)
    offsets = torch.arange(inputs.shape[1], device=inputs.device)[None]
    positions = ((lengths - 1)[:, None] + offsets).clamp(max=S - 1)
    live = (offsets <= valid[:, None]).int().reshape(-1) if drafts is not None and greedy else None
    return inputs, valid, positions, live


def _update_budget(budget, valid, n_acc, k: int) -> None:
    """Adaptive draft length (as HF's assisted generation schedules it): a row whose drafts were all accepted may
    verify two more next step, one that saw a rejection one fewer, within 1..k; a step without drafts says nothing."""
    grown = torch.where(n_acc >= valid, (budget + 2).clamp(max=k), (budget - 1).clamp(min=1))
    budget.copy_(torch.where(valid > 0, grown, budget))


def _finish_step(history, lengths, active, out, drafts, valid, logits, accept, proposed) -> torch.Tensor:
    n_acc, tokens = accept(drafts, valid, logits)
    _record(history, lengths, active, out, n_acc, tokens)
    out[:, -1].copy_(proposed)
    return n_acc


class Decoder:
    """Runs one target model with an optional drafter and a fixed k under a recipe's settings."""

    def __init__(self, model: Transformer, drafter: Drafter | None = None, k: int = 0, cuda_graphs: bool = True,
                 eos_token_ids: tuple[int, ...] = (), tokenizer=None, compile: bool = False,
                 kernels: dict[str, str] | Kernels | None = None, overlap: bool = False, compile_mode: str = "default",
                 layer: str = "modular", adaptive_drafts: bool = False, ar_after_miss: bool = False):
        if drafter is None:
            k = 0
        if drafter is not None and k < 1:
            raise ValueError(f"a drafter needs k >= 1, got k={k}")
        self.model, self.drafter, self.k = model, drafter, k
        self.adaptive_drafts = adaptive_drafts and k > 0
        self.ar_after_miss = ar_after_miss and k > 0
        self.cuda_graphs = cuda_graphs and model.device.type == "cuda"
        self.pad_prompts = self.cuda_graphs  # to a multiple of PREFILL_WIDTH_STEP: few prefill graphs
        self.ops = kernels if isinstance(kernels, Kernels) else resolve_kernels(kernels)
        # Prefill is one long, compute-bound pass: fused SDPA there whatever the step's attention slot holds (the
        # math version would materialize a [B, heads, T, S] score tensor).
        self.prefill_ops = self.ops._replace(attention=attention_sdpa)
        # Compiling fuses each layer's norms, rotary embedding and activations, and the drafter's and acceptance's
        # many small ops, into few kernels. Layers are compiled as one function shared by all of them (seconds,
        # not the minutes a whole unrolled model takes); prefill and sampling stay eager.
        compile = compile and model.device.type == "cuda"
        self.layer_fn = compiled(Block.forward, compile_mode) if compile else Block.forward
        if layer == "fused":  # steps of few tokens in five Triton kernels a layer; others stay modular
            from ..kernels.triton_fused_layer import layer_function

            self.layer_fn = layer_function(self.layer_fn)
        self._finish = compiled(_finish_step) if compile else _finish_step
        self._inputs = compiled(_step_inputs) if compile else _step_inputs
        self._update_budget = compiled(_update_budget) if compile else _update_budget
        if drafter is not None:
            drafter.prepare(self.ops, self.layer_fn, compile)
        self.tokenizer = tokenizer
        self.overlap = overlap
        self.eos_token_ids = eos_token_ids
        self._cache: KVCache | None = None
        self._graphs: dict = {}
        self._prefill_graphs: dict = {}  # (B, padded length) -> (graph, static inputs, logits)
        self._prefill_pool = None
        self.last_stats = BatchStats()
        # Profiling hook (specpilot.tools.profile.profiler.PhaseTimer): when set, greedy steps run eagerly (no CUDA graph)
        # and `mark(point)` is called at each phase boundary of a step. Decoding is otherwise unchanged.
        self.phase_timer = None

    def _mark(self, point: str) -> None:
        if self.phase_timer is not None:
            self.phase_timer.mark(point)

    # -- one step ------------------------------------------------------------------------------------------------
    def _step(self, st: DecodeState, sampling: SamplingParams, generator, verify: bool = True) -> None:
        """One decoding step; with verify=False (ar_after_miss) an AR step whose drafter only reports what it found."""
        k = self.k
        drafts = proposed = prop = None
        found = torch.zeros_like(st.lengths)
        if k:
            prop = self.drafter.propose(st.history, st.lengths, k, sampling, generator)
            found = prop.valid
            if verify:
                drafts, proposed = prop.tokens, prop.valid
            self._mark("draft")
        inputs, valid, positions, live = self._inputs(st.history, st.lengths, st.budget, drafts, proposed,
                                                      self.adaptive_drafts, sampling.greedy)
        skip = {} if live is None else {"live": live}
        logits = self.model(inputs, positions, self._cache, ops=self.ops, layer_fn=self.layer_fn, **skip)
        self._mark("verify")
        if sampling.greedy:
            n_acc = self._finish(st.history, st.lengths, st.active, st.out, inputs[:, 1:], valid, logits,
                                 self.ops.accept, found)
        else:
            q = prop.probs if drafts is not None else None  # None: one-hot drafts
            n_acc, tokens = accept_sampled(inputs[:, 1:], valid, q, logits, sampling, generator)
            _record(st.history, st.lengths, st.active, st.out, n_acc, tokens)
            st.out[:, -1].copy_(found)
        if drafts is not None:
            if self.adaptive_drafts:
                self._update_budget(st.budget, valid, n_acc, k)
            self.drafter.update(n_acc)
        self._mark("bookkeeping")

    def _run_step(self, st: DecodeState, sampling: SamplingParams, generator, verify: bool = True) -> None:
        if not sampling.greedy:
            return self._step(st, sampling, generator, verify)
        if not self.cuda_graphs or self.phase_timer is not None:
            return self._step(st, sampling, None, verify)
        self._graph(st, sampling, verify).replay()

    def _graph(self, st: DecodeState, sampling: SamplingParams, verify: bool = True):
        """The captured step for this state and kind of step (captured now if it is new)."""
        key = (id(st), self.k, verify)
        graph = self._graphs.get(key)
        if graph is None:
            graph = self._capture(st, sampling, verify)
            # one batch's state at a time (its verification and AR steps); older graphs release their pool
            self._graphs = {**{k: g for k, g in self._graphs.items() if k[0] == id(st)}, key: graph}
        return graph

    def _capture_all(self, st: DecodeState, sampling: SamplingParams) -> None:
        """Capture every kind of step this decoder may launch for `st` before the first one runs, rather than when
        each is first needed (a capture takes tens of milliseconds and may compile): the verification step, and with
        ar_after_miss the AR step."""
        if not (self.cuda_graphs and sampling.greedy and self.phase_timer is None):
            return
        for verify in (True, False) if self.ar_after_miss else (True,):
            self._graph(st, sampling, verify)

    def _main_graph(self):
        """The last batch's verification step (for an AR decoder its only step)."""
        return next(g for key, g in self._graphs.items() if key[2])

    def time_graph_replay(self, replays: int = 20) -> float | None:
        """Device seconds of one captured step: the last batch's graph replayed between CUDA events. The replays
        append junk tokens; the lengths are put back, so the state is as before. None when no graph exists."""
        if not self._graphs:
            return None
        graph, lengths = self._main_graph(), self._state.lengths.clone()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize()
        start.record()
        for _ in range(replays):
            graph.replay()
        end.record()
        torch.cuda.synchronize()
        self._state.lengths.copy_(lengths)
        return start.elapsed_time(end) / 1e3 / replays

    def replay_once(self) -> None:
        """Replay the last captured step once (for a profiler trace); the lengths are put back afterwards."""
        graph, lengths = self._main_graph(), self._state.lengths.clone()
        graph.replay()
        torch.cuda.synchronize()
        self._state.lengths.copy_(lengths)

    def _launch(self, st: DecodeState, sampling: SamplingParams, generator, index: int, verify: bool = True):
        """Enqueue one step and the copy of its outputs to the host; returns what `_read` waits on."""
        self._mark("begin")
        self._run_step(st, sampling, generator, verify)
        if st.out.device.type != "cuda":
            return st.out.clone(), None
        buf = self._host_out[index % 2]
        buf.copy_(st.out, non_blocking=True)
        done = torch.cuda.Event()
        done.record()
        return buf, done

    @staticmethod
    def _read(pending) -> list[list[int]]:
        buf, done = pending
        if done is not None:
            done.synchronize()
        return buf.tolist()

    def _capture(self, st: DecodeState, sampling: SamplingParams, verify: bool = True):
        # Warm up on a side stream (lazy library init must not happen during capture), restoring the state after
        # each run: a step only appends, so restoring history and lengths undoes it.
        saved = (st.history.clone(), st.lengths.clone())
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(2):
                self._step(st, sampling, None, verify)
                st.history.copy_(saved[0])
                st.lengths.copy_(saved[1])
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with capture(graph):
            self._step(st, sampling, None, verify)
        return graph

    def _prefill(self, tokens: torch.Tensor, positions: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        """The prompts' forward pass: their K/V into the cache, and each row's logits at its last token [B, vocab].

        With CUDA graphs it is replayed as a graph captured once per (batch, padded length): eager, a prefill of a
        small model is bound by the host launching its hundreds of kernels one by one (on the H200, SmolLM2's took
        ~25 ms for a prompt the device computes in a few)."""
        def forward(tokens, positions, lengths):
            return self.model(tokens, positions, self._cache, logits_at=(lengths - 1)[:, None],
                              ops=self.prefill_ops)[:, 0]

        if not self.cuda_graphs:
            return forward(tokens, positions, lengths)
        entry = self._prefill_graphs.get(tokens.shape)
        if entry is None:
            static = (tokens.clone(), positions.clone(), lengths.clone())
            stream = torch.cuda.Stream()  # warm up (lazy library init must not happen during capture)
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                forward(*static)
            torch.cuda.current_stream().wait_stream(stream)
            if self._prefill_pool is None:  # one memory pool for all prefill graphs: they never run at once
                self._prefill_pool = torch.cuda.graph_pool_handle()
            graph = torch.cuda.CUDAGraph()
            with capture(graph, pool=self._prefill_pool):
                logits = forward(*static)
            entry = self._prefill_graphs[tokens.shape] = (graph, static, logits)
        graph, static, logits = entry
        for buf, value in zip(static, (tokens, positions, lengths)):
            buf.copy_(value)
        graph.replay()
        return logits

    # -- a batch -------------------------------------------------------------------------------------------------
    def generate(self, prompts: list[list[int]], stop: StopCondition, sampling: SamplingParams = SamplingParams(),
                 seed: int = 0) -> list[RowResult]:
        """Decode a batch of token-id prompts of any lengths together; each row stops on its own."""
        if not prompts or any(len(p) == 0 for p in prompts):
            raise ValueError("every prompt needs at least one token")
        device = self.model.device
        B, longest = len(prompts), max(len(p) for p in prompts)
        width = prefill_width(longest) if self.pad_prompts else longest  # prompts right-padded to this
        max_len = max(cache_length(longest, stop.max_new_tokens, self.k, self.overlap), width)
        if self._cache is None or self._cache.k.shape[1] != B or self._cache.max_len < max_len:
            # (a fresh pool for the new prefill graphs: PyTorch cannot capture into a pool whose graphs are gone)
            self._cache, self._graphs, self._prefill_graphs, self._prefill_pool = None, {}, {}, None
            self._cache = self.model.new_cache(B, max_len)
            self._state = DecodeState(B, max_len, self.k, device)
            if device.type == "cuda":  # two pinned buffers: the host reads one while the next step's copy lands
                self._host_out = [torch.empty_like(self._state.out, device="cpu").pin_memory() for _ in range(2)]
        max_len = self._cache.max_len
        st = self._state
        generator = None
        if not sampling.greedy:
            generator = torch.Generator(device=device).manual_seed(seed)
        results = [RowResult(prompt=list(p)) for p in prompts]
        eos = set(self.eos_token_ids if stop.eos_token_ids is None else stop.eos_token_ids)

        sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
        sync()
        t0 = time.perf_counter()
        with torch.inference_mode():
            lengths = torch.tensor([len(p) for p in prompts], device=device)
            padded = torch.zeros(B, width, dtype=torch.long)
            for b, p in enumerate(prompts):
                padded[b, : len(p)] = torch.tensor(p)
            padded = padded.to(device)
            positions = torch.arange(width, device=device)[None].expand(B, width)
            # Right padding is safe: pad slots lie past each row's end, are masked, and are overwritten later.
            logits = self._prefill(padded, positions, lengths)
            if sampling.greedy:
                first = logits.argmax(-1)
            else:
                first = torch.multinomial(probabilities(logits, sampling), 1, generator=generator).squeeze(1)
            if self.drafter is not None:
                self.drafter.prefill(padded, positions, max_len)
            st.history.zero_()
            st.history[:, :width] = padded
            st.history.scatter_(1, lengths[:, None], first[:, None])
            st.lengths.copy_(lengths + 1)
            st.active.fill_(True)
            st.budget.fill_(self.k)
            first_host = first.tolist()
            t_first = time.perf_counter() - t0
            active = [True] * B
            for b, r in enumerate(results):
                active[b] = self._append(r, [first_host[b]], t_first, stop, eos)
            stats = BatchStats(prefill_s=t_first)
            verify = True  # the next step verifies drafts (else, with ar_after_miss, it is an AR step)

            def launch(step: int):
                stats.ar_steps += not verify
                return self._launch(st, sampling, generator, step, verify)

            pending = None
            if any(active):
                self._capture_all(st, sampling)
                pending = launch(0)
            while pending is not None:
                # With overlap the device runs step i+1 while the host reads step i; a row that finished at step i
                # takes part in step i+1 too, and its extra tokens are dropped (the cache has room for them).
                ahead = launch(stats.steps + 1) if self.overlap else None
                self._mark("sync")
                out = self._read(pending)  # the step's one host sync
                self._mark("synced")
                now = time.perf_counter() - t0
                stats.steps += 1
                changed = False
                for b, r in enumerate(results):
                    if not active[b]:
                        continue
                    n = out[b][0]
                    r.accepted.append(n)
                    if not self._append(r, out[b][1: n + 2], now, stop, eos):
                        active[b], changed = False, True
                if changed:
                    st.active.copy_(torch.tensor(active))
                if self.ar_after_miss:  # verify next only if the drafter found something for a live row
                    verify = any(active[b] and out[b][-1] > 0 for b in range(B))
                self._mark("end")
                if not any(active):
                    break
                pending = ahead or launch(stats.steps)
            sync()
            stats.decode_s = time.perf_counter() - t0 - t_first
        self.last_stats = stats
        if self.tokenizer is not None:
            for r in results:
                r.text = self.tokenizer.decode(r.tokens, skip_special_tokens=True)
        return results

    def _append(self, r: RowResult, new: list[int], now: float, stop: StopCondition, eos: set[int]) -> bool:
        """Append a step's tokens to a row, cut at the first stop condition; False when the row is finished."""
        for tok in new:
            r.tokens.append(tok)
            r.token_times.append(now)
            if tok in eos:
                r.finish_reason = "eos"
            elif len(r.tokens) >= stop.max_new_tokens:
                r.finish_reason = "length"
            elif stop.stop_strings and self._hit_stop_string(r, stop.stop_strings):
                r.finish_reason = "stop"
            if r.finish_reason:
                return False
        return True

    def _hit_stop_string(self, r: RowResult, stops: tuple[str, ...]) -> bool:
        if self.tokenizer is None:
            raise SpecPilotError("stop strings need a tokenizer, and this target has none")
        # Decode only a tail long enough to hold the longest stop string (tokens are at least one character).
        tail = self.tokenizer.decode(r.tokens[-max(len(s) for s in stops) - 8:])
        return any(s in tail for s in stops)
