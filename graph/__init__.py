"""Agent graph (LangGraph): routes cost-model gaps to the kernel-writer, algorithm and scheduler agents."""
