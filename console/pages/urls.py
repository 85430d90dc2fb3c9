"""The console's and the portal's routes: every area module's ``urlpatterns``, one namespace."""

from __future__ import annotations

from django.urls import URLPattern, URLResolver, path

from console.pages import home
from console.pages.nav import area_modules

app_name = "console"

urlpatterns: list[URLPattern | URLResolver] = [
    path("portal/", home.portal_home, name="portal-home"),
]
for _module in area_modules():
    urlpatterns += _module.urlpatterns
