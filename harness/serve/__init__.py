"""Stage 6 of the pipeline, beside the step measurements: serving a workload. Requests of real lengths
arrive over time (workload), an iteration-level scheduler admits and grows them within a KV budget by
the strategy's own accounting (memory, scheduler), and an executor computes each iteration: our decoder
through the strategy's pool, every sequence at its own length (executor), or a model of the step time.
A run's records (records) become the field's metrics (metrics) and one row, with a per-request file
beside it. docs/method.md ("Serving") says what is measured and how.
"""
