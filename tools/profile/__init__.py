"""What a decoding step costs and what it could cost: the cost model (costmodel.py, pure functions), the device's
measured ceilings (calibrate.py), the profiler that times a recipe's step phases and kernels against the model's
floors and ranks the gaps (profiler.py with phase_timer.py, kernel_stats.py), and the GPU validation and step-timing
scripts. Imports engine/ and kernels/ only.
"""
