"""What a run measures: step and epoch timings, their gathers across ranks, and the straggler diagnosis."""
