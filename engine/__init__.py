"""The speculative-decoding engine: models, drafters, decoding loops and recipes."""
