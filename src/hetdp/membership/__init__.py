"""Who takes part in each step's exchange, and bringing the ranks that sat out current before they rejoin."""
