"""The training loop's parts: one step inside the DeepSpeed engine (``engine``, its rules in
``engine_rules``, how a loss is normalised in ``loss``), the step's values read lazily
(``step_values``, ``step_log``), the LR schedule, metrics, validation, faults (stops,
heartbeat) and the engine's teardown."""
