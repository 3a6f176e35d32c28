"""The GSPOJob API: what the operator, the CRD, `gspo train` and the learner all read.

The spec models (`spec`), their validation (`validation`), the pod contract (`ports`: ports,
environment variables, paths, exit codes), the learner's progress document (`progress`), the
built-in tasks and model shapes a spec may name (`tasks`, `model_shape`), the engine arguments
vLLM takes (`engine_args`) and the memory plan of a spec's GPUs (`memory_plan`, `chunking`).

Nothing here imports torch, kopf or a Kubernetes client, and nothing here imports the operator
or the trainer: both import this package, and import-linter (pyproject.toml) keeps the
operator and the trainer from importing each other.
"""
