"""DeepSpeed, imported without the mlflow its autotuner would import along with it.

`import deepspeed` imports deepspeed.autotuning (through deepspeed.runtime.config), whose
autotuner imports mlflow whenever it is installed, only to log autotuning experiments
(DeepSpeed 0.19, deepspeed/autotuning/autotuner.py: `try: import mlflow ... has_mlflow =
True`). This project installs mlflow for its `mlflow` tracker, so every learner rank, and
`gspo train` saving a built-in model (transformers' save_pretrained imports DeepSpeed through
accelerate's `extract_model_from_parallel`), paid for mlflow with pandas and pyarrow: 0.75 s
of CPU on each start, for a learner that never autotunes. `import_deepspeed` hides mlflow
from that one import, so the autotuner records it as absent; afterwards mlflow imports as
usual, for the tracker.
"""

from __future__ import annotations

import sys
from types import ModuleType

UNUSED_AT_IMPORT = ("mlflow",)  # what DeepSpeed's import pulls in and the learner never uses


def import_deepspeed() -> ModuleType:
    """The `deepspeed` module, imported first here (later calls return it as imported)."""
    if "deepspeed" in sys.modules:
        return sys.modules["deepspeed"]
    hidden = [name for name in UNUSED_AT_IMPORT if name not in sys.modules]
    for name in hidden:
        sys.modules[name] = None  # type: ignore[assignment]  # `import name` raises ImportError
    try:
        import deepspeed
    finally:
        for name in hidden:
            if name in sys.modules and sys.modules[name] is None:
                del sys.modules[name]
    return deepspeed
