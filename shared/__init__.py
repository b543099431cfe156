"""What the edge and the worker both import: settings, Redis key names, bus formats, errors, metrics."""
