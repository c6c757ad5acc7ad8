"""Training-loop integrations: gradient hooks and the stats logger."""
