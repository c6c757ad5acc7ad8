"""The family objects users hold: ShardedTensors and its views, gradients, masters, optimizer state."""
