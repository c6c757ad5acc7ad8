"""Operations on a family's local shards: transforms, reductions, writes, noise, overflow."""
