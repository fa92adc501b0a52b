"""Load-testing harness for pdserve and OpenAI-compatible servers (`pdserve bench`).

Modules, one concept each:

- `workload`  what to send: request specs (prompt token ids, output length, class).
- `presets`   named workloads: short, long, mixed.
- `arrivals`  when to send it: Poisson / gamma inter-arrival offsets.
- `record`    what came back: the timeline of one request.
- `metrics`   pure computations over records: latencies, percentiles, goodput.
- `backends`  how to send it: the pdserve gRPC API or an OpenAI `/v1/completions` stream.
- `loadgen`   the open-loop (rate) and closed-loop (concurrency) drivers.
- `runner`    one benchmark run or a sweep over rates, from a `BenchConfig`.
- `report`    terminal table, JSON and PNG plots.
- `gateway_cpu` the gateway's CPU per generated token, from its /metrics.
- `calibration` SLOs from a system's unloaded latencies.
- `search`    the goodput search: raise the rate to the knee, bisect, interpolate.
- `servers`   start/stop of the servers under test (pdserve up, vLLM) for `compare`.
- `compare`   pdserve vs colocated vLLM on the same workload.
- `compare_report` its JSON and table.
- `cli`       the `pdserve bench` subcommands.
"""
