"""One family's storage and state."""
