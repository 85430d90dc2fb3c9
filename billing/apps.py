from django.apps import AppConfig


class BillingConfig(AppConfig):
    name = "billing"
    verbose_name = "Usage and billing"

    def ready(self) -> None:
        # Every process that finalizes an invoice (a web worker, a command) queues its email.
        from billing import tasks  # noqa: F401 - connects billing.tasks' receivers
