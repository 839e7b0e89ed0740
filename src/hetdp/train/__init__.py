"""Training loops and optimizer wrappers a user calls, one per synchronization strategy."""
