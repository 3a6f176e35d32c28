"""The GSPOJob Kubernetes operator: API, rendering, status, and kopf handlers."""

__version__ = "0.1.0"
