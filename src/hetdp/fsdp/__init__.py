"""The sharded drop-in: ``hetdp.fully_shard``, FSDP2 whose ranks compute unequal shares of every step, exactly."""
