"""The optimize graph (docs/AGENTS.md):

    START -> profiler -> router -> {kernel_writer | algorithm | scheduler} (in parallel, Send) -> review
          -> evaluate -> integrator -> remember -> profiler (next round) ... -> report -> END

router goes straight to report when it chooses no agent (no gap promises >= 2%) or a person stops; review sends
a candidate a person redirected to another agent back to that agent, and goes to remember when a person stops;
remember goes to report once the budget (rounds, wall minutes, device minutes) is spent.

Imports are absolute: `langgraph dev` (langgraph.json) loads this file by its path, outside the package.
"""
from __future__ import annotations

from langgraph.graph import END, START, StateGraph

from specpilot.graph.candidates import AGENTS
from specpilot.graph.evaluate import evaluate, integrator
from specpilot.graph.nodes import (after_profiler, after_remember, after_review, after_router, agent_node, profiler,
                                   remember, review, router)
from specpilot.graph.report import report
from specpilot.graph.state import OptimizeState


def build_graph(checkpointer=None):
    """The compiled graph; `checkpointer` (e.g. a SqliteSaver) makes it resumable and interruptible."""
    g = StateGraph(OptimizeState)
    g.add_node("profiler", profiler)
    g.add_node("router", router)
    for agent in AGENTS:
        g.add_node(agent, agent_node(agent))
    g.add_node("review", review)
    g.add_node("evaluate", evaluate)
    g.add_node("integrator", integrator)
    g.add_node("remember", remember)
    g.add_node("report", report)
    g.add_edge(START, "profiler")
    g.add_conditional_edges("profiler", after_profiler, ["router", "report"])
    g.add_conditional_edges("router", after_router, ["report", "remember", *AGENTS])
    for agent in AGENTS:
        g.add_edge(agent, "review")
    g.add_conditional_edges("review", after_review, ["evaluate", "remember", *AGENTS])
    g.add_edge("evaluate", "integrator")
    g.add_edge("integrator", "remember")
    g.add_conditional_edges("remember", after_remember, ["profiler", "report"])
    g.add_edge("report", END)
    return g.compile(checkpointer=checkpointer)


# For langgraph.json / LangGraph Studio, which supplies its own persistence.
graph = build_graph()
