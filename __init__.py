"""SpecPilot: speculative decoding of a deployment made as fast as the hardware allows, without changing outputs."""
__version__ = "0.1.0"
