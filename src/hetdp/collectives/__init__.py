"""How contributions are combined: partial collectives on top of torch.distributed."""
