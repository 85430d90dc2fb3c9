from django.apps import AppConfig


class RegistryConfig(AppConfig):
    name = "registry"
    verbose_name = "Model registry"

    def ready(self) -> None:
        # Every process that starts the bundled models' import (a web worker) queues its task.
        from registry import tasks  # noqa: F401 - connects registry.tasks' receivers
