"""The sweep: BOUNCE against UCX (plain, SGL, multi-threaded) over descriptor size x count x
requests in flight x operation x memory x application shape, two processes, every backend in
the same run and interleaved. `python -m benches.sweep --help`; results go to
bench-results/<timestamp>/ (table.txt, sweep.csv, PNG plots, summary.txt).

Modules, one job each: plan (dimensions, presets, backend variants, point order), worker (the
process on each side: agents, buffers, the measured closed loop), driver (spawns the worker
pairs and walks the plan with a progress bar), report (table, CSV, ratios, gate derivation,
summary), plots (matplotlib figures).
"""
