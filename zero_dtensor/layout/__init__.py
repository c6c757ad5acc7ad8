"""Where every element of a family lives: flat layouts and placements, plans, tilings, rows, segments, views and devices."""
