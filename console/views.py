"""Console pages for the ML team."""

from __future__ import annotations

from django.contrib.auth.decorators import login_required, user_passes_test
from django.http import HttpRequest, HttpResponse
from django.shortcuts import render

from registry.selectors import model_list_with_versions

# Staff (the ML team) only; anyone else is sent to the console's own login page.
staff_required = user_passes_test(lambda user: user.is_active and user.is_staff)


@login_required
@staff_required
def home(request: HttpRequest) -> HttpResponse:
    return render(request, "console/home.html", {"models": model_list_with_versions()})
