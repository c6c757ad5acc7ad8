"""Transport: process groups, collectives, point-to-point exchanges and the rank agreement."""
