"""The tokenbus processes: the edge (HTTP), the worker (engine) and the command line that runs them."""
