from django.apps import AppConfig


class ConsoleConfig(AppConfig):
    name = "console"
    verbose_name = "Console"

    def ready(self) -> None:
        # The management API's authentication in its OpenAPI schema (a drf-spectacular
        # extension registers itself when its module is imported).
        from console import openapi  # noqa: F401
