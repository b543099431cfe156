"""How every process reaches Redis: its clients (bounded pools, named connections) and lean raw pipelines. The
one place redis-py's private parts are used (`internals`), so that a redis-py upgrade is checked in one file."""
