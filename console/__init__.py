"""The Django project package: settings, ASGI entry, URLs, the Celery app and the browser UI."""

from console.celery import app as celery_app

__all__ = ["celery_app"]
