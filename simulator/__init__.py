"""ioaware simulator: measurement on this machine and reports (hardware specs, the cost model and the tile
simulator arrive with their issues)."""
