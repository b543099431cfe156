"""The wire protocol between edges and workers: the job and event formats, every Redis key name, the order of a
job's events, its event log and the errors both sides raise. Knows nothing of the API formats or of processes."""
