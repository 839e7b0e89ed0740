"""What the workers are: cluster descriptions, probes that measure them, and single-machine emulation."""
