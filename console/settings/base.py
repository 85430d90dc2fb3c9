"""The Django project itself: apps, middleware, URLs, templates, i18n, static files, DRF and
its OpenAPI schema, the console's live view, logging."""

from __future__ import annotations

import os
from pathlib import Path

import django_stubs_ext

from .env import envfloat

#: The repository root (the folder holding manage.py): a Path.
BASE_DIR = Path(__file__).resolve().parent.parent.parent

# Lets admin classes and querysets be subscripted (ModelAdmin[Model]) at run time.
django_stubs_ext.monkeypatch()

#: Django apps, in load order: Django's own, DRF, Channels, then the platform's layers.
INSTALLED_APPS = [
    "daphne",
    "django.contrib.admin",
    "django.contrib.auth",
    "django.contrib.contenttypes",
    "django.contrib.sessions",
    "django.contrib.messages",
    "django.contrib.staticfiles",
    "django.contrib.postgres",
    "rest_framework",
    "drf_spectacular",
    "drf_spectacular_sidecar",  # Swagger UI and Redoc served from static, never from a CDN
    "channels",
    "console",
    "accounts",
    "registry",
    "serving",
    "billing",
    "rollout",
]

#: Django middleware for the console, admin and management API (the data plane has its own).
MIDDLEWARE = [
    "django.middleware.security.SecurityMiddleware",
    "django.contrib.sessions.middleware.SessionMiddleware",
    "django.middleware.common.CommonMiddleware",
    "django.middleware.csrf.CsrfViewMiddleware",
    "django.contrib.auth.middleware.AuthenticationMiddleware",
    "django.contrib.messages.middleware.MessageMiddleware",
    "django.middleware.clickjacking.XFrameOptionsMiddleware",
]

#: The root URLconf (a dotted module path).
ROOT_URLCONF = "console.urls"
#: The ASGI entry point (HTTP and WebSocket through Channels; a dotted path).
ASGI_APPLICATION = "console.asgi.application"
#: No WSGI entry point: the platform is served over ASGI only.
WSGI_APPLICATION = None

#: Django's template engine: templates/ plus each app's, with the house context processors.
TEMPLATES = [
    {
        "BACKEND": "django.template.backends.django.DjangoTemplates",
        "DIRS": [BASE_DIR / "templates"],
        "APP_DIRS": True,
        "OPTIONS": {
            "context_processors": [
                "django.template.context_processors.request",
                "django.contrib.auth.context_processors.auth",
                "django.contrib.messages.context_processors.messages",
                "console.pages.nav.navigation",
            ],
            # The house formats (money, UTC times) in every template without a {% load %}.
            "builtins": ["console.templatetags.formats"],
        },
    },
]

#: How often the console's live overview (console/consumers.py) pushes fresh figures (seconds).
CONSOLE_LIVE_INTERVAL_SECONDS = envfloat("CONSOLE_LIVE_INTERVAL_SECONDS", 5.0)

#: The UI's language (a language tag).
LANGUAGE_CODE = "en-us"
#: Every time is stored and shown in UTC (a tz database name).
TIME_ZONE = "UTC"
#: Django's translation machinery is on.
USE_I18N = True
#: Datetimes are timezone-aware.
USE_TZ = True

#: The URL prefix static files are served under.
STATIC_URL = "/static/"
#: Folders of static files besides each app's static/ (Paths).
STATICFILES_DIRS = [BASE_DIR / "static"]
#: Where static files are found (dotted class paths).
STATICFILES_FINDERS = [
    "django.contrib.staticfiles.finders.FileSystemFinder",
    "django.contrib.staticfiles.finders.AppDirectoriesFinder",
    "console.staticfinders.PlotlyFinder",  # plotly/plotly.min.js from the plotly package
]
#: Where collectstatic gathers static files (a Path).
STATIC_ROOT = BASE_DIR / "staticfiles"

#: Django REST framework's defaults for the management API (/api/v1/).
REST_FRAMEWORK = {
    "DEFAULT_SCHEMA_CLASS": "drf_spectacular.openapi.AutoSchema",
    "DEFAULT_AUTHENTICATION_CLASSES": [
        "rest_framework.authentication.SessionAuthentication",
        # Under the login page's lockout (console.auth): no unlimited password guessing.
        "console.auth.RateLimitedBasicAuthentication",
    ],
    "DEFAULT_PERMISSION_CLASSES": ["rest_framework.permissions.IsAuthenticated"],
}
# As the management API's schema and the Open Inference Protocol's server metadata (GET /v2)
# report it.
#: The platform's version (a version string).
PLATFORM_VERSION = "0.1.0"
#: drf-spectacular's settings for the management API's OpenAPI schema and its docs pages.
SPECTACULAR_SETTINGS = {
    "TITLE": "Inference platform management API",
    "VERSION": PLATFORM_VERSION,
    "SERVE_INCLUDE_SCHEMA": False,
    # Served from our static files (drf-spectacular-sidecar): the docs work offline.
    "SWAGGER_UI_DIST": "SIDECAR",
    "SWAGGER_UI_FAVICON_HREF": "SIDECAR",
    "REDOC_DIST": "SIDECAR",
    # No badge fetched from Swagger's online validator.
    "SWAGGER_UI_SETTINGS": {"deepLinking": True, "validatorUrl": None},
    "ENUM_NAME_OVERRIDES": {
        "RoleEnum": "accounts.models.Role",
        "InvitedRoleEnum": "accounts.models.INVITABLE_ROLES",
        # Every "status" field needs its own name once two choice sets share it.
        "DeploymentStatusEnum": "registry.models.Deployment.Status",
        "InvoiceStatusEnum": "billing.models.Invoice.Status",
    },
    # console.openapi documents the errors every DRF view may answer; the data plane is served
    # by serving.gateway.asgi, not DRF, so serving.openapi adds it to the schema.
    "POSTPROCESSING_HOOKS": [
        "drf_spectacular.hooks.postprocess_schema_enums",
        "console.openapi.document_errors",
        "serving.openapi.add_data_plane",
    ],
}

#: Logging: one plain line per record on stderr at LOG_LEVEL (default INFO); noisy libraries at WARNING.
LOGGING = {
    "version": 1,
    "disable_existing_loggers": False,
    "formatters": {"plain": {"format": "%(asctime)s %(levelname)s %(name)s %(message)s"}},
    "handlers": {"console": {"class": "logging.StreamHandler", "formatter": "plain"}},
    "root": {"handlers": ["console"], "level": os.environ.get("LOG_LEVEL", "INFO")},
    "loggers": {
        "django.db.backends": {"level": "WARNING"},
        "httpx": {"level": "WARNING"},  # one INFO line per engine request is noise
        "httpcore": {"level": "WARNING"},
    },
}
