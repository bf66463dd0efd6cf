"""Trace replay: a discrete-event simulation of a Mooncake cluster driven by a request trace.

The scheduling code is the real one (`policies.Scheduler`, the `KVIndex` fed with block events,
`admission`); only the instances are simulated, timed by a `CostModel`. `replay.run` replays
one policy; `mooncake replay` runs all of them and prints the table.
"""
