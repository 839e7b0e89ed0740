"""Step checkpoints: written atomically, read without running code, resumed on any number of ranks."""
