from __future__ import annotations

from django.contrib import admin
from django.contrib.auth import views as auth_views
from django.urls import include, path
from drf_spectacular.views import SpectacularAPIView, SpectacularSwaggerView

from console import health
from console.auth import RateLimitedLoginView
from console.monitoring import engine_targets_view, platform_metrics_view
from console.pages import home
from serving.gateway.metrics import metrics_view

# Django's admin under the product's name (it says "Django administration" otherwise).
admin.site.site_header = "Inference platform admin"
admin.site.site_title = "Inference platform admin"
admin.site.index_title = "Records"

urlpatterns = [
    path("", home.home, name="home"),
    path("healthz", health.healthz, name="healthz"),
    path("readyz", health.readyz, name="readyz"),
    path("metrics", metrics_view, name="metrics"),
    path("metrics/platform", platform_metrics_view, name="platform-metrics"),
    path("metrics/engines", engine_targets_view, name="engine-targets"),
    path("", include("serving.urls")),
    path("admin/", admin.site.urls),
    path("accounts/login/", RateLimitedLoginView.as_view(), name="login"),
    path("accounts/logout/", auth_views.LogoutView.as_view(), name="logout"),
    path("accounts/", include("django.contrib.auth.urls")),  # password change and reset
    path("", include("console.pages.urls")),
    path("api/", include("accounts.urls")),
    path("api/", include("billing.urls")),
    # Management paths under /api/v1/ that the data plane does not claim (serving.gateway.asgi.DATA_PLANE_PREFIXES).
    path("api/v1/", include("registry.urls")),
    path("api/v1/", include("rollout.urls")),
    path("api/v1/", include("serving.shadow.api")),
    path("api/cache/", include("serving.semcache.api")),
    path("api/schema/", SpectacularAPIView.as_view(), name="schema"),
    path("api/docs/", SpectacularSwaggerView.as_view(url_name="schema"), name="api-docs"),
]
