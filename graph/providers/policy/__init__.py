"""The policy provider: deterministic, no LLM, the offline default.

It proposes from a built-in mechanism catalog per agent and picks the parameters with the cost model
(tools/profile/costmodel.py) on the profile's own deployment: its calibrated ceilings, model shape, measured kernel counts and
measured acceptance per draft position. Memory comes first: a change that passed the gate and sped things up on a
similar deployment is proposed before the catalog; one that failed there is not proposed at all. Every candidate's
reason carries the numbers that justified it. docs/PROVIDERS.md describes the catalog.

The package owns the policy's decisions, one concern a module, each importing only modules named before it here:
costview.py, the profiled deployment in cost-model terms; recipes.py, the agents' recipe fields and patches applied,
checked and compared by effect; memory.py, past outcomes read as verdicts; catalog.py, what the agents' catalogs share
(MIN_GAIN, Option, Skips, the profile's gaps); algorithm.py, scheduler.py and kernel_writer.py, each agent's catalog;
provider.py, PolicyProvider, which routes and proposes. This module only re-exports them, for
`from specpilot.graph.providers.policy import ...`.
"""
from __future__ import annotations

# A name re-exported here is this module's own binding: patching it here (MIN_GAIN, say) changes nothing in the modules
# that read it, so a test patches it in each of them (tests/test_synthetic.py does).
from .algorithm import (HEAD_K, HEAD_K_MAX, HEAD_TREE_TOKENS, HEAD_TREE_TOPK, LAYERSKIP_FRACTIONS, NGRAM_K_CHOICES,
                        NGRAM_MAX_CHOICES, REPLAY_TREE_DRAFTS, TREE_BRANCHES, TREE_MAX_STEP_COST, _ngram_dep,
                        algorithm_options, conditional, fused_fma_tokens, head_shape, random_head_shape)
from .catalog import MIN_GAIN, Option, Skips
from .costview import CostView, _ceilings, break_even_rate, ms, positions
from .kernel_writer import FUSED_12BIT, LOSSLESS12_BYTES_PER_PARAM, kernel_writer_options, needs_triton
from .memory import MemoryVerdict, describe_deployment, memory_agents, memory_speedup, read_memory
from .provider import WHY_SHOWN, PolicyProvider, nothing_why
from .recipes import AGENT_FIELDS, DRAFTER_FIELDS, agent_name, apply_patch, checkable_patch, patch_error, recipe_effect
from .scheduler import BATCH_FRACTIONS, RAGGED_MAX_AVAILABILITY, _fraction_options, batching_options, scheduler_options

__all__ = ["AGENT_FIELDS", "BATCH_FRACTIONS", "CostView", "DRAFTER_FIELDS", "FUSED_12BIT", "HEAD_K", "HEAD_K_MAX",
           "HEAD_TREE_TOKENS", "HEAD_TREE_TOPK", "LAYERSKIP_FRACTIONS", "LOSSLESS12_BYTES_PER_PARAM", "MIN_GAIN",
           "MemoryVerdict", "NGRAM_K_CHOICES", "NGRAM_MAX_CHOICES", "Option", "PolicyProvider",
           "RAGGED_MAX_AVAILABILITY", "REPLAY_TREE_DRAFTS", "Skips", "TREE_BRANCHES", "TREE_MAX_STEP_COST", "WHY_SHOWN",
           "_ceilings", "_fraction_options", "_ngram_dep", "agent_name", "algorithm_options", "apply_patch",
           "batching_options", "break_even_rate", "checkable_patch", "conditional", "describe_deployment",
           "fused_fma_tokens", "head_shape", "kernel_writer_options", "memory_agents", "memory_speedup", "ms",
           "needs_triton", "nothing_why", "patch_error", "positions", "random_head_shape", "read_memory",
           "recipe_effect", "scheduler_options"]
