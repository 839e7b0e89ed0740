"""The data side of the drop-in: each step cut by the shares, data a rank holds alone, and the random state."""
