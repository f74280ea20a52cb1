"""Prompt templates, one per agent."""
