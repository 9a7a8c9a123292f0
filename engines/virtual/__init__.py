"""A virtual device for scheduling work on a CPU (as Vidur does for LLM serving): the real service,
worker, scheduler and clients run; the talker's and codec decoder's device work become waits of
the costs a GPU measured (``benchmarks/costs/*.json``). costs.py reads the table, clock.py is the
device timeline, graphs.py the graph captures, talker.py and vocoder.py the two pipelines' device
sides, device.py puts them together. docs/VIRTUAL_DEVICE.md says how to run and calibrate it."""
