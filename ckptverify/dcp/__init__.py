"""Everything that knows how PyTorch DCP lays a checkpoint out on disk."""
