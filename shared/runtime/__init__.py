"""What every tokenbus process runs on: its settings, metrics and their endpoint, logs, the event loop, the loops
that live as long as a block, and the startup heap kept away from the collector."""
