"""The replicated drop-in, ``hetdp.DDP``: torch DDP whose ranks compute unequal shares of every step."""
